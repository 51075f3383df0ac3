"""Requests and tokens per second, from cumulative counters sampled whenever the dashboard polls."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Sample:
    at: float
    requests: int
    tokens: int


@dataclass(slots=True, frozen=True)
class Rates:
    requests_per_s: float | None  # None until two samples span at least `min_span` seconds
    tokens_per_s: float | None


class RateMeter:
    """Keeps recent (time, total requests, total tokens) samples; rate = slope over the last `window` s."""

    def __init__(self, window: float = 10.0, min_span: float = 0.5) -> None:
        self.window, self.min_span = window, min_span
        self._samples: deque[Sample] = deque()
        self._lock = threading.Lock()

    def observe(self, requests: int, tokens: int, now: float | None = None) -> Rates:
        """Record the counters' current totals and return the rates over the window ending now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._samples.append(Sample(now, requests, tokens))
            while len(self._samples) > 2 and now - self._samples[1].at >= self.window:
                self._samples.popleft()
            first = self._samples[0]
        span = now - first.at
        if span < self.min_span:
            return Rates(None, None)
        return Rates(max(0, requests - first.requests) / span, max(0, tokens - first.tokens) / span)
