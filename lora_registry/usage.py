"""Usage records: what every finished request used, written in batches, summed per key or adapter.

`UsageStore.insert_many(entries)` stores one row per `UsageEntry` in one transaction (the server's
background writer calls it, never a request). `UsageStore.summary(...)` answers "who used how much":

    SELECT bucket(at), <key or adapter>, count(*), sum(prompt_tokens), ...
    FROM usage_records WHERE start <= at < end [AND adapter = ...] [AND api_key = ...]
    GROUP BY 1, 2

Buckets are hours or days in UTC, computed from the epoch seconds in SQL on SQLite and PostgreSQL alike.
Statuses: "ok", "error", "aborted" (the client went away) and "rate_limited" (refused with 429, no
tokens). `requests` counts what ran (everything but "rate_limited"); `failed` counts error + aborted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, Integer, case, cast, func, insert, select
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from lora_registry.dbsession import transaction
from lora_registry.errors import RegistryError
from lora_registry.models import UsageRecord
from lora_registry.schemas import _Json

STATUSES = ("ok", "error", "aborted", "rate_limited")
GROUPS = {"key": UsageRecord.api_key, "adapter": UsageRecord.adapter}
BUCKETS = {"hour": 3600, "day": 86400}


@dataclass(slots=True, frozen=True)
class UsageEntry:
    """One finished request, as the server records it (`at` is an aware UTC datetime)."""

    at: datetime
    api_key: str | None
    adapter: str | None
    adapter_digest: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_ms: int
    status: str


@dataclass(slots=True, frozen=True)
class UsageRow(_Json):
    """Totals of one key or adapter (`name`; None = no key / the base model) in one bucket (None when
    not bucketed: the whole range)."""

    bucket: datetime | None
    name: str | None
    requests: int
    failed: int
    rate_limited: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


@dataclass(slots=True, frozen=True)
class UsageReport(_Json):
    """`rows` sorted by bucket, then name; the range is [start, end)."""

    by: str
    bucket: str | None
    start: datetime
    end: datetime
    rows: tuple[UsageRow, ...]


class UsageStore:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def insert_many(self, entries: Sequence[UsageEntry]) -> None:
        """Store all `entries` in one transaction (all or none)."""
        if not entries:
            return
        rows = [
            {
                "at": e.at,
                "api_key": e.api_key,
                "adapter": e.adapter,
                "adapter_digest": e.adapter_digest,
                "prompt_tokens": e.prompt_tokens,
                "completion_tokens": e.completion_tokens,
                "cached_tokens": e.cached_tokens,
                "latency_ms": e.latency_ms,
                "status": e.status,
            }
            for e in entries
        ]
        with transaction(self.sessions) as s:
            s.execute(insert(UsageRecord), rows)

    def summary(
        self,
        by: str,
        start: datetime,
        end: datetime,
        bucket: str | None = None,
        *,
        adapter: str | None = None,
        api_key: str | None = None,
    ) -> UsageReport:
        """Totals per key or adapter (`by`) over [start, end), per hour or day when `bucket` is given."""
        if by not in GROUPS:
            raise RegistryError(f"by must be one of {', '.join(GROUPS)}, got {by!r}")
        if bucket is not None and bucket not in BUCKETS:
            raise RegistryError(f"bucket must be one of {', '.join(BUCKETS)}, got {bucket!r}")
        if start.tzinfo is None or end.tzinfo is None:
            raise RegistryError("start and end must carry a time zone")
        if end <= start:
            raise RegistryError("the end of the range must be after its start")
        group = GROUPS[by]
        ran = UsageRecord.status != "rate_limited"
        with transaction(self.sessions) as s:
            bucket_col = _bucket_start(s, BUCKETS[bucket]) if bucket else None
            cols = [
                group.label("name"),
                func.sum(case((ran, 1), else_=0)).label("requests"),
                func.sum(case((UsageRecord.status.in_(("error", "aborted")), 1), else_=0)).label("failed"),
                func.sum(case((ran, 0), else_=1)).label("rate_limited"),
                func.sum(UsageRecord.prompt_tokens).label("prompt"),
                func.sum(UsageRecord.completion_tokens).label("completion"),
                func.sum(UsageRecord.cached_tokens).label("cached"),
            ]
            keys: list[Any] = [group]
            if bucket_col is not None:
                cols.insert(0, bucket_col.label("bucket"))
                keys.insert(0, bucket_col)
            q = select(*cols).where(UsageRecord.at >= start, UsageRecord.at < end).group_by(*keys)
            if adapter is not None:
                q = q.where(UsageRecord.adapter == adapter)
            if api_key is not None:
                q = q.where(UsageRecord.api_key == api_key)
            result = s.execute(q).mappings().all()
        rows = [
            UsageRow(
                bucket=datetime.fromtimestamp(int(r["bucket"]), UTC) if bucket_col is not None else None,
                name=r["name"],
                requests=int(r["requests"] or 0),
                failed=int(r["failed"] or 0),
                rate_limited=int(r["rate_limited"] or 0),
                prompt_tokens=int(r["prompt"] or 0),
                completion_tokens=int(r["completion"] or 0),
                cached_tokens=int(r["cached"] or 0),
                total_tokens=int(r["prompt"] or 0) + int(r["completion"] or 0),
            )
            for r in result
        ]
        rows.sort(key=lambda r: (r.bucket or start, r.name or ""))
        return UsageReport(by, bucket, start, end, tuple(rows))


def _bucket_start(session: Session, size: int) -> ColumnElement:
    """Unix time of the start of the `size`-second bucket holding each row's `at` (UTC)."""
    if session.get_bind().dialect.name == "sqlite":  # `at` is stored as naive UTC text
        seconds: ColumnElement = cast(func.strftime("%s", UsageRecord.at), Integer)
        return (seconds // size) * size
    epoch = func.floor(func.extract("epoch", UsageRecord.at) / size)
    return cast(epoch, BigInteger) * size
