"""Rate limits of API keys and adapters, stored in the registry (`rate_limits`), by name.

A subject ("key" NAME or "adapter" NAME) has up to three limits: requests per minute, tokens per minute
and concurrent requests; a missing (NULL) limit is no limit. `LimitStore.set` changes only the limits
it is given (`0` removes one); a subject left with no limit loses its row. Every change is audited and
published as a `limits.changed` event through the outbox, so every server re-reads the limits at once
(this one right after the commit, the others when Redis delivers it; all also re-read them every few
seconds), and a change made while Redis is down still succeeds. The server enforces them
(`api.limits`); the registry only stores them.
"""

from __future__ import annotations

import builtins  # `list` is also a method name in this module's classes
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.converters import audit
from lora_registry.dbsession import transaction
from lora_registry.errors import NotFound, RegistryError
from lora_registry.events import EventBus, RegistryEvent
from lora_registry.models import LIMIT_KINDS, Adapter, ApiKey, RateLimit
from lora_registry.names import validate_name
from lora_registry.outbox import Outbox
from lora_registry.schemas import _Json

LIMITS_CHANGED = "limits.changed"
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
MAX_LIMIT = 1_000_000_000  # the largest value any limit may take


@dataclass(slots=True, frozen=True)
class LimitInfo(_Json):
    """The limits of one key or adapter (None = unlimited)."""

    kind: str
    name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    updated_at: datetime | None = None

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f) is None for f in LIMIT_FIELDS)


def check_limit(field: str, value: int | None) -> None:
    """`RegistryError` unless `value` is None or an integer in [0, MAX_LIMIT] (0 = remove the limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
        raise RegistryError(f"{field} must be an integer from 0 (no limit) to {MAX_LIMIT}, got {value!r}")


def _info(row: RateLimit) -> LimitInfo:
    return LimitInfo(
        kind=row.kind,
        name=row.name,
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        max_concurrent=row.max_concurrent,
        updated_at=row.updated_at,
    )


class LimitStore:
    def __init__(self, sessions: sessionmaker[Session], bus: EventBus, outbox: Outbox | None = None) -> None:
        self.sessions = sessions
        self.bus = bus
        self.outbox = outbox or Outbox(sessions, bus)

    def set(
        self,
        kind: str,
        name: str,
        *,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        max_concurrent: int | None = None,
        actor: str = "local",
    ) -> LimitInfo:
        """Change the given limits of key or adapter `name` (None: unchanged, 0: removed).

        `NotFound` when no adapter (or key) has that name: a limit on a typo would silently do nothing.
        """
        self._check_kind(kind)
        validate_name(name, "key name" if kind == "key" else "adapter name")
        given = {
            "requests_per_minute": requests_per_minute,
            "tokens_per_minute": tokens_per_minute,
            "max_concurrent": max_concurrent,
        }
        for field, value in given.items():
            check_limit(field, value)
        with transaction(self.sessions) as s:
            owner = Adapter if kind == "adapter" else ApiKey
            if s.scalars(select(owner.id).where(owner.name == name)).first() is None:
                raise NotFound(f"no {'adapter' if kind == 'adapter' else 'key'} named {name!r}")
            row = s.scalars(select(RateLimit).where(RateLimit.kind == kind, RateLimit.name == name)).first()
            if row is None:
                row = RateLimit(kind=kind, name=name)
                s.add(row)
            for field, value in given.items():
                if value is not None:
                    setattr(row, field, value or None)
            changes = {f: v for f, v in given.items() if v is not None}
            audit(s, actor, LIMITS_CHANGED, f"{kind}:{name}", **changes)
            s.flush()
            info = _info(row)
            if info.is_empty:
                s.delete(row)
            self.outbox.add(s, RegistryEvent(type=LIMITS_CHANGED, name=f"{kind}:{name}"))
        self.outbox.flush()  # Redis down: this server has applied it already; the relay tells the others
        return info

    def get(self, kind: str, name: str) -> LimitInfo:
        """The limits of `name` (all None when it has none)."""
        self._check_kind(kind)
        with transaction(self.sessions) as s:
            row = s.scalars(select(RateLimit).where(RateLimit.kind == kind, RateLimit.name == name)).first()
            return _info(row) if row is not None else LimitInfo(kind, name, None, None, None)

    def list(self) -> builtins.list[LimitInfo]:
        """Every key and adapter that has a limit, by kind and name."""
        with transaction(self.sessions) as s:
            rows = s.scalars(select(RateLimit).order_by(RateLimit.kind, RateLimit.name))
            return [_info(r) for r in rows]

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in LIMIT_KINDS:
            raise RegistryError(f"a limit belongs to one of {', '.join(LIMIT_KINDS)}, got {kind!r}")
