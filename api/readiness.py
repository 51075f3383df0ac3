"""Readiness (`GET /ready`): the engine is up, the registry database answers, and this replica can read
the weights of every active adapter, checked quickly.

Liveness (`/health`) only says the process and its engine run; readiness also needs the registry, since
a replica that cannot reach it cannot serve newly activated adapters or check API keys. The database
probe has a short time limit and at most one probe runs at a time (concurrent checks share it), so a
stalled database costs one thread, however often a load balancer asks.

Blobs (`BlobCheck`): replicas that share a registry database must share its blobs too. What shows they
do not is not the configuration alone (a local blob store on a shared filesystem works) but an active
adapter, recorded in the shared registry, whose weights this replica's local store lacks: it would
list the adapter and fail every request for it. Then `/ready` is 503 with `blobs: "not shared: ..."`
naming the adapters. The check applies to the local blob store with any database other than the data
dir's own SQLite file; the database blob store is shared by construction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("loraplex.ready")


@dataclass(slots=True, frozen=True)
class Readiness:
    engine: str  # "ok", "down" or "restarting"
    registry: str  # "ok", "unreachable" or "timeout"
    events: str  # informational: "redis", "redis (disconnected)" or "in-process"
    blobs: str = "ok"  # "ok", "not shared: ..." (see `BlobCheck`), "unchecked" (registry down), "timeout"

    @property
    def ready(self) -> bool:
        return self.engine == "ok" and self.registry == "ok" and self.blobs == "ok"

    def body(self) -> dict[str, Any]:
        status = "ready" if self.ready else "not ready"
        return {
            "status": status,
            "engine": self.engine,
            "registry": self.registry,
            "events": self.events,
            "blobs": self.blobs,
        }


class RegistryProbe:
    """`await probe.check()` → "ok" (or the string `ping` returned), "unreachable" (it raised) or
    "timeout" (no answer within `timeout` seconds)."""

    def __init__(self, ping: Callable[[], str | None], timeout: float = 2.0) -> None:
        self.ping = ping
        self.timeout = timeout
        self._inflight: asyncio.Future[str | None] | None = None

    async def check(self) -> str:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.get_running_loop().run_in_executor(None, self.ping)
        try:
            answer = await asyncio.wait_for(asyncio.shield(self._inflight), self.timeout)
        except TimeoutError:
            return "timeout"
        except Exception as exc:
            log.warning("readiness: registry probe failed: %s", exc)
            return "unreachable"
        return answer or "ok"


@dataclass(slots=True)
class BlobCheck:
    """`check()` → None when this replica can read every active adapter's weights, else the reason.

    `registry` is the `Registry`, `active` returns the active adapters (name → `ActiveAdapter`) as the
    follower holds them. Digests found readable are remembered (blobs are immutable), so a check costs
    a database read only for adapters not yet seen readable."""

    registry: Any
    active: Callable[[], dict[str, Any]]
    _readable: set[str] = field(default_factory=set)

    def applies(self) -> bool:
        settings = self.registry.settings
        return settings.blob_store == "local" and not settings.uses_default_database

    def check(self) -> str | None:
        if not self.applies():
            return None
        adapters = self.registry.adapters
        unseen = {a.digest: name for name, a in self.active().items() if a.digest not in self._readable}
        for digest in [d for d in unseen if adapters.materialized_path(d) is not None]:
            del unseen[digest]  # its PEFT directory is on disk already
            self._readable.add(digest)
        blobs = adapters.blob_digests(unseen) if unseen else {}
        missing = []
        for digest, name in sorted(unseen.items(), key=lambda item: item[1]):
            pair = blobs.get(digest)
            if pair is not None and all(adapters.blobs.exists(b) for b in pair):
                self._readable.add(digest)
            elif pair is not None:
                missing.append(name)
        if not missing:
            return None
        names = ", ".join(repr(n) for n in missing[:5])
        if len(missing) > 5:
            names += f" and {len(missing) - 5} more"
        root = adapters.blobs.root
        return (
            f"not shared: the registry database is shared, but blobs are in this replica's local store "
            f"({root}), which lacks the weights of active adapter(s) {names}; set LORAPLEX_BLOB_STORE="
            f"database on every replica (or put the data dir on a filesystem they all share)"
        )


def events_state(bus: object) -> str:
    """How registry events reach this process (informational; readiness does not depend on it)."""
    subs = getattr(bus, "_subs", None)
    if type(bus).__name__ != "RedisEventBus" or not subs:
        return "in-process"
    connected = all(s.connected.is_set() for s in subs)
    return "redis" if connected else "redis (disconnected)"
