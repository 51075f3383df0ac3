"""Usage records and rate limits in the registry, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from lora_registry.errors import InvalidName, NotFound, RegistryError
from lora_registry.events import RegistryEvent
from lora_registry.limits import LIMITS_CHANGED
from lora_registry.registry import Registry
from lora_registry.usage import UsageEntry

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)


def entry(
    at: datetime, key: str | None, adapter: str | None, p: int, c: int, status: str = "ok"
) -> UsageEntry:
    return UsageEntry(at, key, adapter, "d" * 64 if adapter else None, p, c, p // 2, 12, status)


@pytest.fixture
def usage_rows(registry: Registry) -> Registry:
    registry.usage.insert_many(
        [
            entry(T0 + timedelta(minutes=1), "team-a", "support", 10, 5),
            entry(T0 + timedelta(minutes=59, seconds=59), "team-a", "support", 20, 7),
            entry(T0 + timedelta(hours=1), "team-b", "support", 4, 1, "error"),
            entry(T0 + timedelta(hours=1, minutes=5), "team-b", None, 3, 3, "aborted"),
            entry(T0 + timedelta(hours=2), "team-b", "copy", 0, 0, "rate_limited"),
            entry(T0 + timedelta(days=1), None, "copy", 8, 8),  # the next day
            entry(T0 - timedelta(seconds=1), "team-a", "support", 1000, 1000),  # before the range
        ]
    )
    return registry


def test_summary_totals_by_adapter_and_key(usage_rows: Registry) -> None:
    end = T0 + timedelta(days=2)
    by_adapter = {r.name: r for r in usage_rows.usage.summary("adapter", T0, end).rows}
    assert set(by_adapter) == {"support", "copy", None}
    s = by_adapter["support"]
    assert (s.requests, s.failed, s.rate_limited) == (3, 1, 0)
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens, s.total_tokens) == (34, 13, 5 + 10 + 2, 47)
    c = by_adapter["copy"]
    assert (c.requests, c.rate_limited, c.total_tokens) == (1, 1, 16)
    assert by_adapter[None].failed == 1
    by_key = {r.name: r.total_tokens for r in usage_rows.usage.summary("key", T0, end).rows}
    assert by_key == {"team-a": 42, "team-b": 11, None: 16}
    only_support = usage_rows.usage.summary("key", T0, end, adapter="support").rows
    assert {r.name: r.total_tokens for r in only_support} == {"team-a": 42, "team-b": 5}


def test_summary_buckets_are_utc_hours_and_days(usage_rows: Registry) -> None:
    end = T0 + timedelta(days=2)
    hourly = usage_rows.usage.summary("adapter", T0, end, "hour", adapter="support").rows
    assert [(r.bucket, r.requests, r.total_tokens) for r in hourly] == [
        (T0, 2, 42),  # 10:01 and 10:59:59 fall in the 10:00 bucket
        (T0 + timedelta(hours=1), 1, 5),
    ]
    daily = usage_rows.usage.summary("key", T0, end, "day").rows
    day0 = T0.replace(hour=0)
    assert [(r.bucket, r.name, r.total_tokens) for r in daily] == [
        (day0, "team-a", 42),
        (day0, "team-b", 11),
        (day0 + timedelta(days=1), None, 16),
    ]


def test_summary_refuses_bad_arguments(registry: Registry) -> None:
    with pytest.raises(RegistryError, match="by must be"):
        registry.usage.summary("model", T0, T0 + timedelta(hours=1))
    with pytest.raises(RegistryError, match="bucket must be"):
        registry.usage.summary("key", T0, T0 + timedelta(hours=1), "week")
    with pytest.raises(RegistryError, match="after its start"):
        registry.usage.summary("key", T0, T0)


def test_limits_set_change_clear_and_audit(
    registry: Registry, adapter_copy, events: list[RegistryEvent], tmp_path: Path
) -> None:
    registry.adapters.register("support", adapter_copy("a"))
    registry.keys.create("team-a", adapters=["support"])
    info = registry.limits.set("adapter", "support", requests_per_minute=60, max_concurrent=2, actor="t")
    assert (info.requests_per_minute, info.tokens_per_minute, info.max_concurrent) == (60, None, 2)
    info = registry.limits.set("adapter", "support", tokens_per_minute=1000, max_concurrent=0)
    assert (info.requests_per_minute, info.tokens_per_minute, info.max_concurrent) == (60, 1000, None)
    registry.limits.set("key", "team-a", requests_per_minute=5)
    assert [(i.kind, i.name) for i in registry.limits.list()] == [("adapter", "support"), ("key", "team-a")]
    assert registry.limits.get("key", "team-a").requests_per_minute == 5
    cleared = registry.limits.set("key", "team-a", requests_per_minute=0)
    assert cleared.is_empty and registry.limits.get("key", "team-a").is_empty
    assert [(i.kind, i.name) for i in registry.limits.list()] == [("adapter", "support")]
    assert [e.name for e in events if e.type == LIMITS_CHANGED] == [
        "adapter:support",
        "adapter:support",
        "key:team-a",
        "key:team-a",
    ]
    assert any(a.action == LIMITS_CHANGED and a.actor == "t" for a in registry.adapters.audit_log())


def test_deleting_an_adapter_deletes_its_limits(registry: Registry, adapter_copy) -> None:
    registry.adapters.register("support", adapter_copy("a"))
    registry.limits.set("adapter", "support", requests_per_minute=60)
    registry.adapters.delete("support")
    assert registry.limits.list() == []
    registry.adapters.register("support", adapter_copy("b"))  # a new adapter under the old name
    assert registry.limits.get("adapter", "support").is_empty


def test_limits_refuse_unknown_names_and_bad_values(registry: Registry) -> None:
    with pytest.raises(NotFound, match="no adapter named 'nope'"):
        registry.limits.set("adapter", "nope", requests_per_minute=1)
    with pytest.raises(NotFound, match="no key named 'nope'"):
        registry.limits.set("key", "nope", requests_per_minute=1)
    with pytest.raises(InvalidName):
        registry.limits.set("adapter", "Bad Name", requests_per_minute=1)
    with pytest.raises(RegistryError, match="requests_per_minute must be an integer"):
        registry.limits.set("adapter", "x", requests_per_minute=-1)
    with pytest.raises(RegistryError, match="a limit belongs to"):
        registry.limits.get("model", "x")
