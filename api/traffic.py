"""Per-adapter traffic in one-minute buckets, for the admin dashboard's charts (last hour kept)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

BASE = "(base)"


@dataclass(slots=True)
class Bucket:
    requests: int = 0
    tokens: int = 0


class TrafficLog:
    def __init__(self, keep_minutes: int = 60) -> None:
        self.keep = keep_minutes
        self._buckets: dict[int, dict[str, Bucket]] = defaultdict(lambda: defaultdict(Bucket))
        self._lock = threading.Lock()
        self.last_used: dict[str, float] = {}
        self.totals: dict[str, Bucket] = defaultdict(Bucket)

    def record(self, adapter: str | None, tokens: int, now: float | None = None) -> None:
        """Count one finished request of `adapter` (None = base model) that generated `tokens`."""
        now = time.time() if now is None else now
        key = adapter or BASE
        minute = int(now // 60)
        with self._lock:
            b = self._buckets[minute][key]
            b.requests += 1
            b.tokens += tokens
            t = self.totals[key]
            t.requests += 1
            t.tokens += tokens
            self.last_used[key] = now
            for old in [m for m in self._buckets if m < minute - self.keep]:
                del self._buckets[old]

    def series(self, minutes: int = 15, now: float | None = None) -> tuple[list[int], dict[str, list[int]]]:
        """(minute start times, {adapter: tokens per minute}) for the last `minutes` minutes."""
        now = time.time() if now is None else now
        last = int(now // 60)
        mins = list(range(last - minutes + 1, last + 1))
        with self._lock:
            names = sorted({k for m in mins for k in self._buckets.get(m, {})})
            data = {n: [self._buckets.get(m, {}).get(n, Bucket()).tokens for m in mins] for n in names}
        return [m * 60 for m in mins], data
