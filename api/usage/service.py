"""`UsageLimits`: a server's usage accounting and rate limiting, started and closed by its lifespan.

The generation routes' `RequestRun` calls `admit(...)` before a request runs (429 over a limit) and
`record(...)` once it has finished, whatever the outcome; neither waits for the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from api.limits.backend import LimiterBackend, LocalLimiter
from api.limits.limiter import Grant, LimitTable, RequestLimiter
from api.usage.recorder import UsageRecorder
from api.usage.settings import UsageSettings
from lora_registry.events import RegistryEvent
from lora_registry.limits import LIMITS_CHANGED
from lora_registry.registry import Registry
from lora_registry.usage import UsageEntry

log = logging.getLogger("loraplex.usage")


class UsageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.written = Counter("loraplex_usage_records_written", "Usage records stored", registry=registry)
        self.dropped = Counter(
            "loraplex_usage_records_dropped",
            "Usage records lost (writer queue full, or the database down at shutdown)",
            registry=registry,
        )
        self.backend_errors = Counter(
            "loraplex_rate_limit_backend_errors",
            "Rate-limit checks or releases that failed because Redis was unreachable",
            registry=registry,
        )
        self.refused = Counter(
            "loraplex_rate_limited_requests",
            "Requests refused with 429 by a limit",
            ["limit"],
            registry=registry,
        )


def key_name(key: Any) -> str | None:
    """How usage and limits name a request's caller: the API key's name, "admin", or None."""
    if key is None or key == "admin":
        return key
    return key.name


class UsageLimits:
    def __init__(
        self,
        recorder: UsageRecorder | None,
        limiter: RequestLimiter | None,
        metrics: UsageMetrics,
        refresher: asyncio.Task | None = None,
        subscription: Any = None,
    ) -> None:
        self.recorder, self.limiter, self.metrics = recorder, limiter, metrics
        self._refresher, self._subscription = refresher, subscription

    @classmethod
    async def start(
        cls,
        registry: Registry,
        settings: UsageSettings,
        prometheus: CollectorRegistry,
        redis_url: str | None = None,
    ) -> UsageLimits:
        """Start the usage writer and the limiter (Redis-backed when `redis_url` is set)."""
        metrics = UsageMetrics(prometheus)
        recorder = None
        if settings.accounting:
            recorder = UsageRecorder(
                registry.usage.insert_many,
                settings.queue_size,
                settings.flush_seconds,
                settings.batch_size,
                on_written=metrics.written.inc,
                on_dropped=metrics.dropped.inc,
            ).start()
        if not settings.limits:
            return cls(recorder, None, metrics)
        table = LimitTable(registry.limits.list)
        await asyncio.to_thread(table.reload)
        backend: LimiterBackend
        if redis_url:
            from api.limits.redis_limiter import RedisLimiter

            backend = RedisLimiter(redis_url, lease_seconds=settings.lease_seconds)
        else:
            backend = LocalLimiter()
        limiter = RequestLimiter(
            backend,
            table,
            settings.fail_mode,
            on_backend_error=metrics.backend_errors.inc,
            on_refusal=lambda what: metrics.refused.labels(what).inc(),
        )

        def on_event(event: RegistryEvent) -> None:
            if event.type == LIMITS_CHANGED:
                table.reload()

        subscription = await asyncio.to_thread(registry.bus.subscribe, on_event, table.reload)
        refresher = asyncio.create_task(_reload_forever(table, settings.limits_refresh_seconds))
        return cls(recorder, limiter, metrics, refresher, subscription)

    async def admit(self, key: Any, adapter: str | Sequence[str] | None, tokens: int) -> Grant:
        """Admit a request of `key` on `adapter` (a weighted mix: on each of its adapters) that may use
        `tokens` (429 over a limit)."""
        if self.limiter is None:
            return Grant()
        return await self.limiter.admit(key_name(key), adapter, tokens)

    def record(self, entry: UsageEntry) -> None:
        if self.recorder is not None:
            self.recorder.record(entry)

    async def close(self) -> None:
        """Stop following the limits, finish pending releases, write every queued usage record."""
        if self._refresher is not None:
            self._refresher.cancel()
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                self._subscription.close()
        if self.limiter is not None:
            await self.limiter.close()
        if self.recorder is not None and not await asyncio.to_thread(self.recorder.close):
            log.error("usage: the writer did not finish in time; queued records may be lost")


async def _reload_forever(table: LimitTable, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await asyncio.to_thread(table.reload)
        except Exception as exc:  # keep the last known limits while the database is away
            log.warning("rate limits: reload failed: %s", exc)


def usage_entry(
    key: Any,
    adapter: str | None,
    digest: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    latency_s: float,
    status: str,
) -> UsageEntry:
    """The record of one finished request (finished now)."""
    return UsageEntry(
        at=datetime.now(UTC),
        api_key=key_name(key),
        adapter=adapter,
        adapter_digest=digest,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        latency_ms=max(0, round(latency_s * 1000)),
        status=status,
    )
