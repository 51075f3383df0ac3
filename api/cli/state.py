"""Per-invocation CLI state: the global options and a lazily opened backend."""

from __future__ import annotations

import dataclasses
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
    # (bytes, bytes per element) of the serving engine's side budget, checked at local registration
    # (`adapters register --lora-side-memory-bytes`); None: not checked here (the engine checks at load)
    side_budget: tuple[int, int] | None = None
    _backend: Backend | None = None

    def settings(self) -> RegistrySettings:
        env = dict(os.environ)
        if self.data_dir is not None:
            env["LORAPLEX_DATA_DIR"] = str(self.data_dir)
        settings = RegistrySettings.from_env(env)
        if self.side_budget is not None:
            settings = dataclasses.replace(settings, lora_side_budget=self.side_budget)
        return settings

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
