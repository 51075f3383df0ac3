"""What a rate-limit backend does, and the in-process one.

A request is admitted when every one of its token buckets holds its cost and every one of its
concurrency slots has room, all checked and charged in one atomic step (so a request refused by its
adapter's limit takes nothing from its key's budget).

Token bucket of `capacity` per minute (requests or tokens), refilled continuously:

    level = min(capacity, level + elapsed_seconds * capacity / 60)     # a missing bucket starts full
    admit if level >= cost; then level -= cost
    retry after (cost - level) / (capacity / 60) seconds; full again after (capacity - level) / rate

Concurrency slot of `limit`: a set of leases (one per admitted request), admitted while it holds fewer
than `limit`; `release` removes the lease and refunds the unused part of each token charge.

`LocalLimiter` keeps this state in the process (one server); `RedisLimiter` (`redis_limiter.py`) runs
the same rules as one Lua script in Redis, so that replicas sharing a Redis share the limits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Bucket:
    """One token bucket to charge: `key` names it (e.g. "adapter:support:tokens")."""

    key: str
    capacity: int  # per minute
    cost: int

    @property
    def rate(self) -> float:
        """Refill per second."""
        return self.capacity / 60.0


@dataclass(slots=True, frozen=True)
class Slot:
    """One concurrency limit to hold a lease in."""

    key: str
    limit: int


@dataclass(slots=True)
class Outcome:
    """The answer to one admission: `levels[i]` is bucket i's level after the step (charged when
    admitted); `refused` indexes the first refusing bucket (or `len(buckets) + j` for slot j)."""

    allowed: bool
    levels: list[float] = field(default_factory=list)
    retry_after: float = 0.0
    refused: int = -1


class LimiterUnavailable(Exception):
    """The shared limiter state (Redis) cannot be reached."""


class LimiterBackend(Protocol):
    async def acquire(self, buckets: Sequence[Bucket], slots: Sequence[Slot], lease: str) -> Outcome: ...

    async def release(self, slots: Sequence[Slot], lease: str, refunds: Sequence[Bucket]) -> None:
        """Free `lease` in `slots` and give each refund bucket's `cost` back (up to its capacity)."""
        ...

    async def close(self) -> None: ...


def refill(level: float, elapsed: float, bucket: Bucket) -> float:
    """The level after `elapsed` seconds of refilling (never above the capacity)."""
    return min(float(bucket.capacity), level + max(0.0, elapsed) * bucket.rate)


class LocalLimiter:
    """Token buckets and leases in this process (no I/O; `clock` is injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (level, at)
        self._leases: dict[str, set[str]] = {}

    def _level(self, bucket: Bucket, now: float) -> float:
        level, at = self._buckets.get(bucket.key, (float(bucket.capacity), now))
        return refill(level, now - at, bucket)

    def try_acquire(self, buckets: Sequence[Bucket], slots: Sequence[Slot], lease: str) -> Outcome:
        now = self.clock()
        levels = [self._level(b, now) for b in buckets]
        out = Outcome(True)
        for i, (b, level) in enumerate(zip(buckets, levels, strict=True)):
            if level < b.cost:
                out = Outcome(False, retry_after=(b.cost - level) / b.rate, refused=i)
                break
        if out.allowed:
            for j, s in enumerate(slots):
                if len(self._leases.get(s.key, ())) >= s.limit:
                    out = Outcome(False, retry_after=1.0, refused=len(buckets) + j)
                    break
        if out.allowed:
            levels = [lv - b.cost for lv, b in zip(levels, buckets, strict=True)]
            for s in slots:
                self._leases.setdefault(s.key, set()).add(lease)
        for b, lv in zip(buckets, levels, strict=True):
            self._buckets[b.key] = (lv, now)
        out.levels = levels
        return out

    async def acquire(self, buckets: Sequence[Bucket], slots: Sequence[Slot], lease: str) -> Outcome:
        return self.try_acquire(buckets, slots, lease)

    def release_now(self, slots: Sequence[Slot], lease: str, refunds: Sequence[Bucket]) -> None:
        for s in slots:
            held = self._leases.get(s.key)
            if held is not None:
                held.discard(lease)
                if not held:
                    del self._leases[s.key]
        now = self.clock()
        for b in refunds:
            self._buckets[b.key] = (min(float(b.capacity), self._level(b, now) + b.cost), now)

    async def release(self, slots: Sequence[Slot], lease: str, refunds: Sequence[Bucket]) -> None:
        self.release_now(slots, lease, refunds)

    def in_use(self, key: str) -> int:
        """Leases held in slot `key`."""
        return len(self._leases.get(key, ()))

    async def close(self) -> None:
        return None
