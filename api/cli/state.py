"""Per-invocation CLI state: the global options and a lazily opened backend."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import typer

from api.cli.backend import Backend, LocalBackend, remote_backend
from lora_registry.settings import RegistrySettings


@dataclass(slots=True)
class CliState:
    """Global options; the backend opens on first use, so `--help` never touches the database."""

    data_dir: Path | None
    server: str | None
    token: str | None
    _backend: Backend | None = None

    def settings(self) -> RegistrySettings:
        env = dict(os.environ)
        if self.data_dir is not None:
            env["LORAPLEX_DATA_DIR"] = str(self.data_dir)
        return RegistrySettings.from_env(env)

    def backend(self) -> Backend:
        if self._backend is None:
            if self.server:
                self._backend = remote_backend(self.server, self.token)
            else:
                from lora_registry.registry import open_registry  # lazy: alembic is slow to import

                self._backend = LocalBackend(open_registry(self.settings()))
        return self._backend

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


def state_of(ctx: typer.Context) -> CliState:
    obj = ctx.find_root().obj
    assert isinstance(obj, CliState), "the root callback sets the CLI state"
    return obj
