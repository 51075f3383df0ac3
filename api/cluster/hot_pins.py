"""`HotPins`: a replica keeps the pages of the hot adapters spread onto it (no colder adapter evicts them).

The affinity router spreads a hot adapter over several replicas (`api.cluster.placement`); every request
the ingress sends carries the router's current map (replica → digests of the hot adapters placed there).
A replica takes its own entry as a lease of `lease_s` seconds, renewed by each request that names it,
and pins those adapters in its engine's device pool while they are resident there (pinned adapters are
never evicted). A lease that is not renewed (the adapter contracted off this replica, or the ingress that
spread it is gone) ends with an unpin. At most `max_pinned` adapters are pinned at once (one device slot
is always left to the rest), hot ones first by lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

log = logging.getLogger("loraplex.replica")


class HotPins:
    def __init__(
        self,
        replica_id: str,
        pin: Callable[[str, bool], Awaitable[object]],
        max_pinned: int,
        lease_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pin(digest, True|False)` pins or unpins one adapter in the engine."""
        self.replica_id = replica_id
        self.pin = pin
        self.max_pinned = max(0, max_pinned)
        self.lease_s = lease_s
        self.clock = clock
        self.leases: dict[str, float] = {}  # digest -> when its lease ends
        self.pinned: set[str] = set()
        self._lock = asyncio.Lock()

    def renew(self, hot: dict[str, list[str]] | None) -> None:
        """Renew the leases of the hot adapters the router placed on this replica."""
        until = self.clock() + self.lease_s
        for digest in (hot or {}).get(self.replica_id, ()):
            self.leases[digest] = until

    async def sync(self, resident: Iterable[str]) -> None:
        """Pin the leased adapters among `resident` (on this engine's device), up to `max_pinned`; unpin
        those whose lease ended. Failures (an engine restarting) are logged and retried on the next sync."""
        async with self._lock:
            now = self.clock()
            for digest in [d for d, until in self.leases.items() if until < now]:
                del self.leases[digest]
            on_device = set(resident)
            wanted = sorted(
                (d for d in self.leases if d in on_device or d in self.pinned),
                key=lambda d: -self.leases[d],
            )[: self.max_pinned]
            for digest in sorted(self.pinned - set(wanted)):
                await self._set(digest, False)
            for digest in wanted:
                if digest not in self.pinned:
                    await self._set(digest, True)

    async def _set(self, digest: str, pinned: bool) -> None:
        try:
            await self.pin(digest, pinned)
        except Exception as exc:
            log.info("could not %s hot adapter %s now: %s", "pin" if pinned else "unpin", digest[:12], exc)
            if not pinned:
                self.pinned.discard(digest)  # gone from the engine (removed, or the engine restarted)
            return
        if pinned:
            self.pinned.add(digest)
            log.info("replica %s pins hot adapter %s", self.replica_id, digest[:12])
        else:
            self.pinned.discard(digest)
            log.info("replica %s unpins adapter %s (no longer spread here)", self.replica_id, digest[:12])

    def engine_restarted(self) -> None:
        """A new engine holds no pins."""
        self.pinned.clear()
