"""The registry's service layer, shared by the CLI, the HTTP admin API and the admin UI.

Every mutating call runs in one transaction that also writes an audit-log row and its event's outbox
row; the event is published after the commit (`lora_registry.outbox`: later, if the bus is down).
Adapter versions are immutable; a name points at one of its versions (`current_version`) and is served
while its status is "active".
"""

from __future__ import annotations

import builtins  # `list` is also a method name in this module's classes
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from lora_registry import events as ev
from lora_registry.blobstore import BlobStore
from lora_registry.converters import adapter_info, audit, audit_record, version_info
from lora_registry.dbsession import transaction
from lora_registry.errors import NotFound
from lora_registry.events import EventBus, RegistryEvent
from lora_registry.materialize import drop_unreferenced, materialize, materialized_path
from lora_registry.models import (
    STATUS_ACTIVE,
    STATUS_INACTIVE,
    Adapter,
    AdapterVersion,
    AuditEntry,
    RateLimit,
)
from lora_registry.names import validate_name
from lora_registry.outbox import Outbox
from lora_registry.progress import ProgressReporter
from lora_registry.schemas import (
    ActiveAdapter,
    AdapterDetail,
    AdapterInfo,
    AuditRecord,
    RegisterResult,
)
from lora_registry.settings import RegistrySettings
from lora_registry.version_rows import META_BASE_MODEL as META_BASE_MODEL  # importable here as before
from lora_registry.version_rows import add_version, base_model_path, existing_version

if TYPE_CHECKING:
    from lora_registry.registration import PreparedUpload


def _active_query():
    """(name, version, digest) of active adapters at their current version."""
    return (
        select(Adapter.name, AdapterVersion.version, AdapterVersion.digest)
        .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
        .where(Adapter.status == STATUS_ACTIVE, AdapterVersion.version == Adapter.current_version)
    )


class RegistryService:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        bus: EventBus,
        settings: RegistrySettings,
        outbox: Outbox | None = None,
    ) -> None:
        self.sessions = sessions
        self.blobs = blobs
        self.bus = bus
        self.settings = settings
        self.outbox = outbox or Outbox(sessions, bus)

    # ---- reads ------------------------------------------------------------------------------------

    def list(self) -> list[AdapterInfo]:
        """Every adapter, by name."""
        with transaction(self.sessions) as s:
            rows = s.scalars(select(Adapter).options(selectinload(Adapter.versions)).order_by(Adapter.name))
            return [adapter_info(a) for a in rows]

    def show(self, name: str) -> AdapterDetail:
        """One adapter with all its versions (oldest first)."""
        with transaction(self.sessions) as s:
            a = self._get(s, name)
            return AdapterDetail(adapter_info(a), tuple(version_info(v) for v in a.versions))

    def active_adapters(self) -> builtins.list[ActiveAdapter]:
        """(name, version, digest) of every active adapter: what a serving engine should hold."""
        with transaction(self.sessions) as s:
            return [ActiveAdapter(n, v, d) for n, v, d in s.execute(_active_query().order_by(Adapter.name))]

    def active_adapter(self, name: str) -> ActiveAdapter | None:
        """The served version of `name`, or None if it is unknown or inactive (one indexed lookup)."""
        with transaction(self.sessions) as s:
            row = s.execute(_active_query().where(Adapter.name == name)).first()
            return ActiveAdapter(*row) if row is not None else None

    def materialized_path(self, digest: str) -> Path | None:
        """The PEFT directory of `digest` if `adapter_path` already wrote it, else None (no database)."""
        return materialized_path(self.settings.data_dir, digest)

    def blob_digests(self, digests: Iterable[str]) -> dict[str, tuple[str, str]]:
        """digest -> (config blob, weights blob) of the versions with those content digests."""
        wanted = set(digests)
        if not wanted:
            return {}
        q = select(AdapterVersion.digest, AdapterVersion.config_blob, AdapterVersion.weights_blob).where(
            AdapterVersion.digest.in_(wanted)
        )
        with transaction(self.sessions) as s:
            return {d: (c, w) for d, c, w in s.execute(q)}

    def audit_log(self, limit: int = 100) -> builtins.list[AuditRecord]:
        """The newest `limit` audit entries, newest first."""
        with transaction(self.sessions) as s:
            rows = s.scalars(select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit))
            return [audit_record(e) for e in rows]

    def adapter_path(self, digest: str) -> Path:
        """A PEFT directory holding the adapter with content `digest`, materialized from verified blobs.

        This is the `path` of the engine's `LoRARequest`; the directory is written to a temp dir and renamed
        into `<data dir>/adapters/<digest>`, so it is complete or absent (lora_registry/materialize.py).
        """
        return materialize(self.sessions, self.blobs, self.settings.data_dir, digest)

    # ---- changes ----------------------------------------------------------------------------------

    def register(
        self,
        name: str,
        source: Path,
        *,
        description: str | None = None,
        activate: bool = False,
        actor: str = "local",
        progress: ProgressReporter | None = None,
    ) -> RegisterResult:
        """Validate the adapter at `source` (PEFT dir or zip) and store it as a new version of `name`.

        The new version becomes the name's current version. The same content as an existing version is a
        no-op (`created=False`). A refused adapter leaves no row and no blob.
        """
        validate_name(name)
        from lora_registry.registration import prepare  # lazy: imports torch; reads stay light

        model_path = base_model_path(self.sessions, self.settings.model_path)
        with prepare(source, model_path, self.settings, progress) as up:
            existing = existing_version(self.sessions, name, up.checkpoint.digest)
            if existing is not None:
                info = self.activate(name, actor=actor) if activate else self.show(name).adapter
                return RegisterResult(info, existing, created=False)
            new_blobs = up.store(self.blobs)
            try:
                result = self._insert_version(name, up, description, activate, actor)
            except BaseException:
                self._drop_unreferenced(new_blobs)
                raise
        self.outbox.flush()
        return result

    def _insert_version(
        self, name: str, up: PreparedUpload, description: str | None, activate: bool, actor: str
    ) -> RegisterResult:
        """Add `up` as the next version of `name` (lora_registry/version_rows.py), audited, with its
        events queued in the same transaction."""
        ck = up.checkpoint
        with transaction(self.sessions) as s:
            a, v = add_version(s, name, up, description)
            number = v.version
            if activate:
                a.status = STATUS_ACTIVE
            audit(s, actor, ev.ADAPTER_REGISTERED, name, version=number, digest=ck.digest, activate=activate)
            s.flush()
            info = adapter_info(a)
            self._event(s, ev.ADAPTER_REGISTERED, info)
            if activate:
                self._event(s, ev.ADAPTER_ACTIVATED, info)
            return RegisterResult(info, version_info(v), created=True)

    def activate(self, name: str, *, actor: str = "local") -> AdapterInfo:
        """Serve `name` (its current version)."""
        return self._set_status(name, STATUS_ACTIVE, ev.ADAPTER_ACTIVATED, actor)

    def deactivate(self, name: str, *, actor: str = "local") -> AdapterInfo:
        """Stop serving `name`; its versions stay registered."""
        return self._set_status(name, STATUS_INACTIVE, ev.ADAPTER_DEACTIVATED, actor)

    def _set_status(self, name: str, status: str, event: str, actor: str) -> AdapterInfo:
        with transaction(self.sessions) as s:
            a = self._get(s, name, lock=True)
            changed = a.status != status
            if changed:
                a.status = status
                audit(s, actor, event, name, version=a.current_version)
                s.flush()
            info = adapter_info(a)
            if changed:
                self._event(s, event, info)
        if changed:
            self.outbox.flush()
        return info

    def rollback(self, name: str, version: int, *, actor: str = "local") -> AdapterInfo:
        """Point `name` at its earlier `version` (status unchanged: an active name serves it at once)."""
        with transaction(self.sessions) as s:
            a = self._get(s, name, lock=True)
            if not any(v.version == version for v in a.versions):
                known = ", ".join(str(v.version) for v in a.versions)
                raise NotFound(f"adapter {name!r} has no version {version} (versions: {known})")
            changed = a.current_version != version
            if changed:
                audit(
                    s, actor, ev.ADAPTER_ROLLED_BACK, name, from_version=a.current_version, to_version=version
                )
                a.current_version = version
                s.flush()
            info = adapter_info(a)
            if changed:
                self._event(s, ev.ADAPTER_ROLLED_BACK, info)
        if changed:
            self.outbox.flush()
        return info

    def delete(self, name: str, *, actor: str = "local") -> None:
        """Delete `name`, all its versions and its rate limits (an adapter registered later under the
        same name starts without limits); blobs no other version uses are removed too."""
        with transaction(self.sessions) as s:
            a = self._get(s, name, lock=True)
            blobs = {b for v in a.versions for b in (v.config_blob, v.weights_blob)}
            digests = {v.digest for v in a.versions}
            audit(s, actor, ev.ADAPTER_DELETED, name, versions=len(a.versions))
            s.execute(delete(RateLimit).where(RateLimit.kind == "adapter", RateLimit.name == name))
            s.delete(a)
            self._event(s, ev.ADAPTER_DELETED, None, name=name)
        self._drop_unreferenced(blobs, digests)
        self.outbox.flush()

    # ---- helpers ----------------------------------------------------------------------------------

    def _get(self, s: Session, name: str, lock: bool = False) -> Adapter:
        q = select(Adapter).where(Adapter.name == name)
        a = s.scalars(q.with_for_update() if lock else q).first()
        if a is None:
            raise NotFound(f"no adapter named {name!r}")
        return a

    def _drop_unreferenced(self, blobs: Iterable[str], digests: Iterable[str] = ()) -> None:
        """Delete the given blobs (and materialized dirs) that no remaining version references."""
        drop_unreferenced(self.sessions, self.blobs, self.settings.data_dir, blobs, digests)

    def _event(self, s: Session, kind: str, info: AdapterInfo | None, name: str | None = None) -> None:
        """Queue the event of a change in the change's own transaction (the outbox publishes it)."""
        cur = info.current if info else None
        self.outbox.add(
            s,
            RegistryEvent(
                type=kind,
                name=info.name if info else str(name),
                status=info.status if info else None,
                version=cur.version if cur else None,
                digest=cur.digest if cur else None,
            ),
        )
