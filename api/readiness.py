"""Readiness (`GET /ready`): the engine is up and the registry database answers, checked quickly.

Liveness (`/health`) only says the process and its engine run; readiness also needs the registry, since
a replica that cannot reach it cannot serve newly activated adapters or check API keys. The database
probe has a short time limit and at most one probe runs at a time (concurrent checks share it), so a
stalled database costs one thread, however often a load balancer asks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("loraplex.ready")


@dataclass(slots=True, frozen=True)
class Readiness:
    engine: str  # "ok", "down" or "restarting"
    registry: str  # "ok", "unreachable" or "timeout"
    events: str  # informational: "redis", "redis (disconnected)" or "in-process"

    @property
    def ready(self) -> bool:
        return self.engine == "ok" and self.registry == "ok"

    def body(self) -> dict[str, Any]:
        status = "ready" if self.ready else "not ready"
        return {"status": status, "engine": self.engine, "registry": self.registry, "events": self.events}


class RegistryProbe:
    """`await probe.check()` → "ok", "unreachable" or "timeout" (no answer within `timeout` seconds)."""

    def __init__(self, ping: Callable[[], None], timeout: float = 2.0) -> None:
        self.ping = ping
        self.timeout = timeout
        self._inflight: asyncio.Future[None] | None = None

    async def check(self) -> str:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.get_running_loop().run_in_executor(None, self.ping)
        try:
            await asyncio.wait_for(asyncio.shield(self._inflight), self.timeout)
        except TimeoutError:
            return "timeout"
        except Exception as exc:
            log.warning("readiness: registry probe failed: %s", exc)
            return "unreachable"
        return "ok"


def events_state(bus: object) -> str:
    """How registry events reach this process (informational; readiness does not depend on it)."""
    subs = getattr(bus, "_subs", None)
    if type(bus).__name__ != "RedisEventBus" or not subs:
        return "in-process"
    connected = all(s.connected.is_set() for s in subs)
    return "redis" if connected else "redis (disconnected)"
