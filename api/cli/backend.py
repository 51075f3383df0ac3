"""What the CLI commands talk to: the local registry (data dir), or a running server.

`Backend` is the seam: `LocalBackend` drives `lora_registry` directly; `RemoteBackend`
(`api/cli/remote.py`, made by `remote_backend`) implements the same methods over the server's HTTP
admin API for `--server URL --token T`.
"""

from __future__ import annotations

import builtins  # `list` is also a method name in this module's classes
import getpass
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Protocol

from api.cli.output import CliError
from lora_registry.limits import LimitInfo
from lora_registry.progress import ProgressReporter
from lora_registry.registry import Registry
from lora_registry.schemas import AdapterDetail, AdapterInfo, ApiKeyInfo, CreatedKey, RegisterResult
from lora_registry.usage import UsageReport


class Backend(Protocol):
    def register(
        self, name: str, path: Path, description: str | None, activate: bool, progress: ProgressReporter
    ) -> RegisterResult: ...
    def list(self) -> list[AdapterInfo]: ...
    def show(self, name: str) -> AdapterDetail: ...
    def activate(self, name: str) -> AdapterInfo: ...
    def deactivate(self, name: str) -> AdapterInfo: ...
    def delete(self, name: str) -> None: ...
    def rollback(self, name: str, version: int) -> AdapterInfo: ...
    def create_key(self, name: str, admin: bool, adapters: Sequence[str]) -> CreatedKey: ...
    def list_keys(self) -> builtins.list[ApiKeyInfo]: ...
    def revoke_key(self, name: str) -> ApiKeyInfo: ...
    def usage(
        self,
        by: str,
        start: datetime,
        end: datetime,
        bucket: str | None,
        adapter: str | None,
        key: str | None,
    ) -> UsageReport: ...
    def get_limits(self, kind: str, name: str) -> LimitInfo: ...
    def set_limits(
        self, kind: str, name: str, rpm: int | None, tpm: int | None, conc: int | None
    ) -> LimitInfo: ...
    def close(self) -> None: ...


class LocalBackend:
    """Works on the data dir's registry (`LORAPLEX_DATA_DIR`, `LORAPLEX_DATABASE_URL`)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        try:
            self.actor = f"cli:{getpass.getuser()}"
        except (KeyError, OSError):
            self.actor = "cli"

    def register(
        self, name: str, path: Path, description: str | None, activate: bool, progress: ProgressReporter
    ) -> RegisterResult:
        return self.registry.adapters.register(
            name, path, description=description, activate=activate, actor=self.actor, progress=progress
        )

    def list(self) -> list[AdapterInfo]:
        return self.registry.adapters.list()

    def show(self, name: str) -> AdapterDetail:
        return self.registry.adapters.show(name)

    def activate(self, name: str) -> AdapterInfo:
        return self.registry.adapters.activate(name, actor=self.actor)

    def deactivate(self, name: str) -> AdapterInfo:
        return self.registry.adapters.deactivate(name, actor=self.actor)

    def delete(self, name: str) -> None:
        self.registry.adapters.delete(name, actor=self.actor)

    def rollback(self, name: str, version: int) -> AdapterInfo:
        return self.registry.adapters.rollback(name, version, actor=self.actor)

    def create_key(self, name: str, admin: bool, adapters: Sequence[str]) -> CreatedKey:
        return self.registry.keys.create(name, admin=admin, adapters=adapters, actor=self.actor)

    def list_keys(self) -> builtins.list[ApiKeyInfo]:
        return self.registry.keys.list()

    def revoke_key(self, name: str) -> ApiKeyInfo:
        return self.registry.keys.revoke(name, actor=self.actor)

    def usage(
        self,
        by: str,
        start: datetime,
        end: datetime,
        bucket: str | None,
        adapter: str | None,
        key: str | None,
    ) -> UsageReport:
        return self.registry.usage.summary(by, start, end, bucket, adapter=adapter, api_key=key)

    def get_limits(self, kind: str, name: str) -> LimitInfo:
        return self.registry.limits.get(kind, name)

    def set_limits(
        self, kind: str, name: str, rpm: int | None, tpm: int | None, conc: int | None
    ) -> LimitInfo:
        return self.registry.limits.set(
            kind, name, requests_per_minute=rpm, tokens_per_minute=tpm, max_concurrent=conc, actor=self.actor
        )

    def close(self) -> None:
        self.registry.close()


def remote_backend(server: str, token: str | None) -> Backend:
    """The `--server URL --token T` backend (`LORAPLEX_SERVER`; `LORAPLEX_TOKEN`, else
    `LORAPLEX_ADMIN_TOKEN`)."""
    from api.cli.remote import RemoteBackend, normalize_url  # lazy: local mode does not need httpx

    url = normalize_url(server)
    token = (token or "").strip()
    if not token:
        raise CliError(
            f"--server {url} needs the server's admin token: pass --token or set LORAPLEX_TOKEN "
            "(or LORAPLEX_ADMIN_TOKEN)"
        )
    return RemoteBackend(url, token)
