"""Open a registry from settings: database, blob store, event bus and the two services, wired together."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, text

from lora_registry.admin_sessions import AdminSessionStore
from lora_registry.blobstore import BlobStore, LocalBlobStore
from lora_registry.db import make_engine, make_session_factory
from lora_registry.dbsession import transaction
from lora_registry.errors import RegistryUnavailable, first_line
from lora_registry.events import EventBus, InProcessBus
from lora_registry.keys import KeyService
from lora_registry.limits import LimitStore
from lora_registry.migrate import is_up_to_date, upgrade
from lora_registry.outbox import Outbox, OutboxRelay
from lora_registry.service import RegistryService
from lora_registry.settings import RegistrySettings
from lora_registry.usage import UsageStore


@dataclass(slots=True)
class Registry:
    settings: RegistrySettings
    engine: Engine
    bus: EventBus
    adapters: RegistryService
    keys: KeyService
    usage: UsageStore
    limits: LimitStore
    outbox: Outbox
    admin_sessions: AdminSessionStore
    relay: OutboxRelay | None = None

    def start_outbox_relay(self, interval: float = 1.0) -> OutboxRelay:
        """Deliver pending events (written while the bus was down, or by another process) from a
        background thread every `interval` seconds, until `close()`."""
        if self.relay is None:
            self.relay = OutboxRelay(self.outbox, interval).start()
        return self.relay

    def ping(self) -> None:
        """Check that the database answers (`SELECT 1`); `RegistryUnavailable` if it does not."""
        with transaction(make_session_factory(self.engine)) as s:
            s.execute(text("SELECT 1"))

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        self.bus.close()
        self.engine.dispose()


def make_bus(settings: RegistrySettings) -> EventBus:
    """Redis pub/sub when `LORAPLEX_REDIS_URL` is set, else the in-process bus."""
    if settings.redis_url:
        from lora_registry.redis_bus import RedisEventBus

        return RedisEventBus(settings.redis_url, settings.redis_channel)
    return InProcessBus()


def make_blob_store(settings: RegistrySettings, sessions) -> BlobStore:
    """Local files under the data dir (default), or blobs in the registry database (shared by replicas
    on different machines, cached under the data dir)."""
    cache = LocalBlobStore(settings.data_dir / "blobs")
    if settings.blob_store == "database":
        from lora_registry.db_blobstore import DatabaseBlobStore

        return DatabaseBlobStore(sessions, cache)
    return cache


def open_registry(
    settings: RegistrySettings | None = None, *, bus: EventBus | None = None, auto_upgrade: bool | None = None
) -> Registry:
    """Connect to the registry described by `settings` (default: from the environment).

    `auto_upgrade` (default: only for the data dir's own SQLite file) migrates the schema to the newest
    revision; otherwise an out-of-date schema is reported with the command that fixes it.
    """
    settings = settings or RegistrySettings.from_env()
    engine = make_engine(
        settings.database_url, settings.db_connect_timeout, statement_timeout=settings.db_statement_timeout
    )
    try:
        if auto_upgrade if auto_upgrade is not None else settings.uses_default_database:
            upgrade(settings.database_url)
        elif not is_up_to_date(engine):
            raise RegistryUnavailable(
                "the registry database schema is not up to date: run `loraplex db upgrade`"
            )
    except RegistryUnavailable:
        engine.dispose()
        raise
    except Exception as exc:
        engine.dispose()
        raise RegistryUnavailable(
            f"registry database {engine.url.render_as_string()}: {first_line(exc)}"
        ) from exc
    bus = bus or make_bus(settings)
    sessions = make_session_factory(engine)
    blobs = make_blob_store(settings, sessions)
    outbox = Outbox(sessions, bus)
    return Registry(
        settings,
        engine,
        bus,
        RegistryService(sessions, blobs, bus, settings, outbox),
        KeyService(sessions, bus, outbox),
        UsageStore(sessions),
        LimitStore(sessions, bus, outbox),
        outbox,
        AdminSessionStore(sessions),
    )
