"""`AuthThrottle`: slows down admin-token guessing per client without locking out the real admin.

Shared by the admin JSON API (`RequestGuard`) and the admin UI's login form. A client is its address as
the server sees it (uvicorn trusts `X-Forwarded-For` only from `forwarded_allow_ips`, off by default).

    ok = await throttle.check(client, lambda: admin_auth.check(token))   # None: refused unchecked (429)

- Each wrong token counts as a failure of its client. After `max_failures` within `window` seconds
  the client is throttled: each further attempt waits `delay` seconds before its token is checked,
  and at most `max_waiting` of its attempts may wait at once (more are answered 429 unchecked). A
  throttled client can try about `max_waiting / delay` tokens a second instead of thousands.
- The right token always works: it is never counted as a failure, and a throttled client presenting
  it gets in after the delay. So an attacker sharing the admin's address slows the admin down by a
  second; it cannot lock them out (unless it keeps every waiting slot of that address full).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

MAX_CLIENTS = 10_000  # failure records kept; the oldest client is forgotten beyond this


class AuthThrottle:
    def __init__(
        self, max_failures: int = 10, window: float = 60.0, delay: float = 1.0, max_waiting: int = 2
    ) -> None:
        self.max_failures, self.window, self.delay, self.max_waiting = (
            max_failures,
            window,
            delay,
            max_waiting,
        )
        self._failures: dict[str, deque[float]] = {}
        self._waiting: dict[str, int] = {}

    def throttled(self, client: str) -> bool:
        """Whether `client` has `max_failures` failures within the last `window` seconds."""
        times = self._failures.get(client)
        if not times:
            return False
        cutoff = time.monotonic() - self.window
        while times and times[0] < cutoff:
            times.popleft()
        if not times:
            del self._failures[client]
        return len(times) >= self.max_failures

    async def check(self, client: str, verify: Callable[[], bool]) -> bool | None:
        """`verify()` (is the token right?), delayed while `client` is throttled; None when refused
        without checking because `max_waiting` of the client's attempts already wait."""
        if self.throttled(client):
            if self._waiting.get(client, 0) >= self.max_waiting:
                return None
            self._waiting[client] = self._waiting.get(client, 0) + 1
            try:
                await asyncio.sleep(self.delay)
            finally:
                self._waiting[client] -= 1
                if not self._waiting[client]:
                    del self._waiting[client]
        ok = verify()
        if not ok:
            self.record_failure(client)
        return ok

    def record_failure(self, client: str) -> None:
        if client not in self._failures and len(self._failures) >= MAX_CLIENTS:
            del self._failures[next(iter(self._failures))]
        times = self._failures.setdefault(client, deque(maxlen=self.max_failures))
        times.append(time.monotonic())

    def retry_after(self) -> int:
        return max(1, round(self.delay))
