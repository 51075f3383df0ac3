"""API keys: created once (the secret is shown once), stored as sha256, scoped, revocable.

A key looks like `lpx_<id>_<secret>`; `lpx_<id>` is its public prefix, used to find the row, and the
whole key's sha256 is compared to the stored hash in constant time.
"""

from __future__ import annotations

import builtins  # `list` is also a method name in this module's classes
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lora_registry import events as ev
from lora_registry.converters import audit, key_info
from lora_registry.dbsession import transaction
from lora_registry.errors import Conflict, NotFound, RegistryError
from lora_registry.events import EventBus, RegistryEvent
from lora_registry.models import ApiKey
from lora_registry.names import validate_name
from lora_registry.outbox import Outbox
from lora_registry.schemas import ApiKeyInfo, CreatedKey

KEY_PREFIX = "lpx_"
SCOPE_ADMIN = "admin"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def public_prefix(secret: str) -> str | None:
    """The public part `lpx_<id>` of a key shaped `lpx_<id>_<secret>`, or None for any other string."""
    if not secret.startswith(KEY_PREFIX) or secret.count("_") < 2:
        return None
    return "_".join(secret.split("_", 2)[:2])


@dataclass(slots=True, frozen=True)
class KeyRecord:
    """What checking a key needs: its stored hash and its info (scopes, revocation)."""

    key_hash: str
    info: ApiKeyInfo

    def check(self, secret: str) -> ApiKeyInfo | None:
        """The key's info if `secret` hashes to this record (constant-time) and it is not revoked."""
        ok = hmac.compare_digest(hash_key(secret), self.key_hash)
        return self.info if ok and self.info.revoked_at is None else None


class KeyService:
    def __init__(self, sessions: sessionmaker[Session], bus: EventBus, outbox: Outbox | None = None) -> None:
        self.sessions = sessions
        self.bus = bus
        self.outbox = outbox or Outbox(sessions, bus)

    def create(
        self, name: str, *, admin: bool = False, adapters: Sequence[str] = (), actor: str = "local"
    ) -> CreatedKey:
        """A new key named `name`, scoped to everything (`admin`) or to the named adapters."""
        validate_name(name, "key name")
        if admin == bool(adapters):
            raise RegistryError("a key is either --admin or scoped to one or more --adapter names (not both)")
        scopes = [SCOPE_ADMIN] if admin else [f"adapter:{validate_name(a)}" for a in dict.fromkeys(adapters)]
        public = KEY_PREFIX + secrets.token_hex(6)
        secret = f"{public}_{secrets.token_urlsafe(32)}"
        with transaction(self.sessions) as s:
            if s.scalars(select(ApiKey).where(ApiKey.name == name)).first() is not None:
                raise Conflict(f"a key named {name!r} already exists")
            row = ApiKey(name=name, prefix=public, key_hash=hash_key(secret), scopes=scopes)
            s.add(row)
            audit(s, actor, ev.KEY_CREATED, name, scopes=scopes)
            self.outbox.add(s, RegistryEvent(type=ev.KEY_CREATED, name=name))
            s.flush()
            info = key_info(row)
        self.outbox.flush()
        return CreatedKey(info, secret)

    def list(self) -> list[ApiKeyInfo]:
        with transaction(self.sessions) as s:
            return [key_info(k) for k in s.scalars(select(ApiKey).order_by(ApiKey.name))]

    def revoke(self, name: str, *, actor: str = "local") -> ApiKeyInfo:
        """Revoke key `name`; it stops authenticating at once (revoking twice is a no-op)."""
        with transaction(self.sessions) as s:
            row = s.scalars(select(ApiKey).where(ApiKey.name == name)).first()
            if row is None:
                raise NotFound(f"no key named {name!r}")
            changed = row.revoked_at is None
            if changed:
                row.revoked_at = datetime.now(UTC)
                audit(s, actor, ev.KEY_REVOKED, name)
                self.outbox.add(s, RegistryEvent(type=ev.KEY_REVOKED, name=name))
                s.flush()
            info = key_info(row)
        if changed:
            self.outbox.flush()
        return info

    def verify(self, secret: str) -> ApiKeyInfo | None:
        """The key's info if `secret` is a valid, unrevoked key, else None (constant-time hash compare)."""
        public = public_prefix(secret)
        record = self.record(prefix=public) if public is not None else None
        if record is None:
            hmac.compare_digest(hash_key(secret), hash_key(""))  # same work for unknown keys
            return None
        return record.check(secret)

    def records(self) -> builtins.list[KeyRecord]:
        """Every key's hash and info (revoked ones included): what a server keeps in memory."""
        with transaction(self.sessions) as s:
            return [KeyRecord(k.key_hash, key_info(k)) for k in s.scalars(select(ApiKey))]

    def record(self, *, prefix: str | None = None, name: str | None = None) -> KeyRecord | None:
        """The key with public prefix `prefix` (or named `name`), or None (one indexed lookup)."""
        q = select(ApiKey).where(ApiKey.prefix == prefix) if prefix is not None else None
        if q is None:
            q = select(ApiKey).where(ApiKey.name == name)
        with transaction(self.sessions) as s:
            row = s.scalars(q).first()
            return KeyRecord(row.key_hash, key_info(row)) if row is not None else None
