"""Database tables of the registry (SQLAlchemy 2 ORM). API schemas live in `schemas.py`.

adapters          one row per name: description, status, the version the name points at
adapter_versions  immutable: content digest, blobs, rank/alpha/targets, base-model fingerprint
api_keys          hashed keys with scopes ("admin" or "adapter:<name>")
audit_log         who did which admin action to what, when
registry_meta     small key/value facts (e.g. the base model the registry was set up with)
blobs             content-addressed blobs kept in the database (the "database" blob store backend)
blob_chunks       their bytes, in chunks of at most 8 MiB
usage_records     one row per finished generation request: key, adapter + digest, tokens, latency, status
rate_limits       requests/minute, tokens/minute and concurrent requests of one API key or adapter name
event_outbox      change events written with their change, published to the bus by the relay
admin_sessions    admin UI logins (by the sha256 of the session id), so logout holds everywhere
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

STATUS_ACTIVE = "active"
STATUS_INACTIVE = "inactive"

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite stores it naive; we re-attach UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are not stored; pass an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (CheckConstraint("status IN ('active', 'inactive')", name="status_valid"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(String(16), default=STATUS_INACTIVE)
    current_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter",
        cascade="all, delete-orphan",
        order_by="AdapterVersion.version",
        passive_deletes=True,
    )


class AdapterVersion(Base):
    """One immutable upload of an adapter; updates are refused by a mapper hook below."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_version"),
        UniqueConstraint("adapter_id", "digest", name="uq_adapter_versions_adapter_digest"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    config_blob: Mapped[str] = mapped_column(String(64))
    weights_blob: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float]
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    use_rslora: Mapped[bool]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    base_model_name: Mapped[str | None] = mapped_column(String(512), nullable=True)
    base_model_fingerprint: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class ApiKey(Base):
    """An API key: only `sha256(key)` is stored; `prefix` is the public part used to look it up."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(128))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class RegistryMeta(Base):
    __tablename__ = "registry_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Blob(Base):
    """A blob of the database blob store: its sha256 hex digest, size and number of chunks."""

    __tablename__ = "blobs"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    num_chunks: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class BlobChunk(Base):
    __tablename__ = "blob_chunks"

    digest: Mapped[str] = mapped_column(
        ForeignKey("blobs.digest", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    data: Mapped[bytes] = mapped_column(LargeBinary)


LIMIT_KINDS = ("key", "adapter")


class UsageRecord(Base):
    """One finished request. `api_key` is the key's name ("admin" for the admin token, NULL without
    keys); `adapter` NULL is the base model. Written in batches by the server (`api.usage`)."""

    __tablename__ = "usage_records"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    api_key: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    adapter: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    adapter_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    latency_ms: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))


class RateLimit(Base):
    """The limits of one API key or adapter, by name; a NULL limit is no limit."""

    __tablename__ = "rate_limits"
    __table_args__ = (
        UniqueConstraint("kind", "name", name="uq_rate_limits_kind_name"),
        CheckConstraint("kind IN ('key', 'adapter')", name="kind_valid"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(64))
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class OutboxEvent(Base):
    """A registry event, written in the same transaction as the change it describes; `delivered_at` is
    set once the outbox relay has published it on the event bus (see `lora_registry.outbox`)."""

    __tablename__ = "event_outbox"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    payload: Mapped[str] = mapped_column(Text)  # RegistryEvent.to_json()
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)


class AdminSessionRow(Base):
    """An admin UI login. The cookie carries the session id; only its sha256 is stored here."""

    __tablename__ = "admin_sessions"

    sid_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


@event.listens_for(AdapterVersion, "before_update")
def _versions_are_immutable(mapper: Any, connection: Any, target: AdapterVersion) -> None:
    raise ValueError(f"adapter version {target.id} is immutable")
