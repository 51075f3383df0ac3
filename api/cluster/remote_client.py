"""`RemoteEngineClient`: the ingress's engine client, reaching the engine replicas through Ray Serve.

It has the surface the routes use on `api.engine_client.EngineClient` (`info`, `stats`, `healthy`,
`restarts`, `generate`, `adapter_call`, ...), so the ingress runs the unchanged FastAPI app. A request
for an adapter carries the adapter's content digest as Ray's multiplexed model id: Ray's router prefers
a replica whose multiplexed LRU holds it, and a re-pointed name can never reach stale weights.

Failures: a replica that dies before the request's first token is retried once on another replica
(Ray routes around the dead one); after the first token the request ends with `EngineDeadError` (the
routes answer 503, or an error event in a stream). A replica that refuses an inactive adapter → 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

from api.cluster import ray_api
from api.cluster.replica import decode_item
from api.cluster.replica_header import note_replica
from api.engine_client import EngineDeadError, EngineUnavailableError
from api.engine_protocol import AddRequest, EngineStatsMsg, Ready, RequestDelta, decode_from_engine, encode
from api.errors import APIError
from engine.engine_config import EngineConfig

log = logging.getLogger("loraplex.cluster")


class RemoteEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        deployment: str,
        poll_seconds: float = 0.5,
        retries: int = 1,
        affinity: bool = True,
    ) -> None:
        self.config = config
        self.affinity = affinity  # False: no multiplexed id, Ray's plain load balancing (for comparison)
        self.deployment = deployment
        self.poll_seconds = poll_seconds
        self.retries = retries
        self.info: Ready | None = None
        self.stats: EngineStatsMsg | None = None
        self.healthy = False
        self.restarts = 0
        self.replicas: list[dict[str, Any]] = []  # the latest `describe()` of every live replica
        self.pid = None
        self._handle: Any = None
        self._in_flight = 0
        self._poller: asyncio.Task | None = None

    # ---- life cycle -------------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        """Wait until an engine replica reports its engine ready, then keep polling every replica."""
        self._handle = ray_api.deployment_handle(self.deployment)
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self.poll():
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError("no engine replica became ready")
            await asyncio.sleep(0.2)
        self._poller = asyncio.create_task(self._poll_forever(), name="replica-poller")

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self.poll()
            except Exception as exc:  # a replica restarting; the next poll sees it again
                log.warning("replica poll failed: %s", exc)

    async def poll(self) -> bool:
        """Refresh `replicas`, `stats`, `healthy` from every live replica; True if one is ready."""
        results = await ray_api.broadcast(self._handle, "describe", timeout_s=5.0)
        replicas = [r for r in results if isinstance(r, dict)]
        ready = [r for r in replicas if r["healthy"] and r["info"] is not None]
        self.replicas = replicas
        if ready and self.info is None:
            self.info = cast(Ready, decode_from_engine(ready[0]["info"]))  # a replica's info is its Ready
        self.healthy = bool(ready)
        self.restarts = sum(r["restarts"] for r in replicas)
        stats = [cast(EngineStatsMsg, decode_from_engine(r["stats"])) for r in replicas if r["stats"]]
        self.stats = merge_stats(stats)
        return bool(ready)

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, req: AddRequest) -> AsyncIterator[RequestDelta]:
        """Stream `req`'s deltas from the replica Ray picks for its adapter; see the module doc."""
        if not self.healthy:
            raise EngineUnavailableError("no engine replica is ready")
        payload = encode(req)
        self._in_flight += 1
        try:
            for attempt in range(self.retries + 1):
                started = False
                try:
                    model_id = req.lora.digest if self.affinity and req.lora is not None else None
                    call = ray_api.stream(self._handle, "generate", model_id, payload)
                    async with contextlib.aclosing(ray_api.iterate(call)) as items:
                        async for raw in items:
                            item = decode_item(raw)
                            note_replica(item.replica)
                            if item.refused is not None:
                                raise APIError(404, item.refused, param="model", code="model_not_found")
                            if item.delta is not None:
                                started = True
                                delta = cast(RequestDelta, decode_from_engine(item.delta))
                                yield delta
                                if delta.finish_reason is not None:
                                    return
                    return
                except (APIError, asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception as exc:
                    if not ray_api.is_replica_failure(exc):
                        raise EngineUnavailableError(f"engine replica failed: {exc}") from exc
                    if started or attempt == self.retries:
                        raise EngineDeadError("the engine replica died") from exc
                    log.warning("engine replica died before the first token; retrying (%s)", exc)
        finally:
            self._in_flight -= 1

    async def abort(self, request_ids: list[str]) -> None:
        """Nothing to do: leaving `generate` early cancels the Ray call, which aborts the engine request."""

    async def adapter_call(
        self,
        op: str,
        name: str,
        path: str | None = None,
        digest: str | None = None,
        timeout: float = 120.0,
        keep: Iterable[str] = (),
    ) -> Any:
        """Prefetch and remove are the replicas' own business (each follows the registry); pinning one
        adapter on every replica is not offered with --replicas."""
        if op in ("prefetch", "remove"):
            return None
        raise ValueError(f"adapter operation {op!r} is not available with --replicas")

    def num_in_flight(self) -> int:
        return self._in_flight


def merge_stats(parts: list[EngineStatsMsg]) -> EngineStatsMsg | None:
    """The replicas' statistics as one: counters and block counts summed (per-adapter counters by
    adapter), KV usage over all blocks, adapter names merged, every replica's adapters listed."""
    if not parts:
        return None
    engine: dict[str, Any] = {}
    for p in parts:
        for k, v in p.engine.items():
            if isinstance(v, list):
                engine[k] = sorted(set(engine.get(k, [])) | set(v))
            elif isinstance(v, dict):  # per-adapter counters (e.g. speculative tokens): summed by name
                merged = engine.setdefault(k, {})
                for name, counts in v.items():
                    prev = merged.get(name, [0] * len(counts))
                    merged[name] = [a + b for a, b in zip(prev, counts, strict=True)]
            elif isinstance(v, int | float):
                engine[k] = engine.get(k, 0) + v
    total = engine.get("kv_blocks_total", 0)
    engine["kv_usage"] = engine.get("kv_blocks_used", 0) / total if total else 0.0
    loras = [p.lora for p in parts if p.lora is not None]
    lora = {k: sum(d[k] for d in loras) for k in loras[0]} if loras else None
    return EngineStatsMsg(engine, lora, [a for p in parts for a in p.adapters])
