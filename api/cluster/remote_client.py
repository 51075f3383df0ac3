"""`RemoteEngineClient`: the ingress's engine client, reaching the engine replicas through Ray Serve.

It has the surface the routes use on `api.engine_client.EngineClient` (`info`, `stats`, `healthy`,
`restarts`, `generate`, `adapter_call`, ...), so the ingress runs the unchanged FastAPI app. With
`--router affinity` (the default) the engine deployment's `AffinityRouter` decodes each request and scores
every replica by predicted prefix hit, adapter residency and load. With `--router multiplex` a request
for an adapter carries the adapter's content digest as Ray's multiplexed model id: Ray's router prefers
a replica whose multiplexed LRU holds it. Either way a re-pointed name can never reach stale weights.

Failures: a request whose replica dies, or whose replica's engine process dies or is down, before the
request's first token is retried once on another replica (a retry that Ray routes back to a replica that
already failed it is sent again, within `retry_window_s`, until Serve has routed around that replica);
after the first token the request ends with `EngineDeadError` (the routes answer 503, or an error event in
a stream). A replica that refuses an inactive adapter → 404.

Drain (SIGTERM of `loraplex serve --replicas`): `begin_drain()` refuses new requests with
`ServerShuttingDownError` (503 `server_shutting_down`), and `end_in_flight()`, at the end of the grace,
ends those still running the same way: the single server's contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar, cast

from api.cluster import ray_api, router_stats
from api.cluster.replica import decode_item
from api.cluster.replica_header import note_replica
from api.engine_client import EngineDeadError, EngineUnavailableError, ServerShuttingDownError
from api.engine_protocol import AddRequest, EngineStatsMsg, Ready, RequestDelta, decode_from_engine, encode
from api.errors import APIError
from engine.engine_config import EngineConfig

T = TypeVar("T")

log = logging.getLogger("loraplex.cluster")


class RemoteEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        deployment: str,
        poll_seconds: float = 0.5,
        retries: int = 1,
        affinity: bool = True,
        retry_window_s: float = 15.0,
    ) -> None:
        self.config = config
        # True: the adapter's digest is Ray's multiplexed model id (`--router multiplex`); False: none, and
        # the engine deployment's request router alone picks the replica (`--router affinity` scores
        # prefix, adapter and load; without it, Ray's plain load balancing)
        self.affinity = affinity
        self.deployment = deployment
        self.poll_seconds = poll_seconds
        self.retries = retries
        self.retry_window_s = retry_window_s
        self.per_replica_metrics = True  # `/metrics` labels each replica's gauges with its id
        self.engine_replicas = 1  # engine replicas the ingress admits requests for (set by the deployment)
        # requests the ingress admits at once for all of them (None: `max_num_seqs` each)
        self.engine_capacity: int | None = None
        # the affinity router's counters on `/metrics` (its spreads, contractions, predicted hits)
        self.metric_collectors = [] if affinity else [router_stats.RouterCollector()]
        self.info: Ready | None = None
        self.stats: EngineStatsMsg | None = None
        self.healthy = False
        self.restarts = 0
        self.replicas: list[dict[str, Any]] = []  # the latest `describe()` of every live replica
        self.pid = None
        self._handle: Any = None
        self._in_flight = 0
        self._poller: asyncio.Task | None = None
        self._draining = False
        self._cut = asyncio.Event()  # set by `end_in_flight`
        self._cut_wait: asyncio.Future | None = None

    # ---- life cycle -------------------------------------------------------------------------------
    async def start(self, timeout: float = 1800.0) -> None:
        """Wait until an engine replica reports its engine ready, then keep polling every replica.

        While the engine deployment has no replica running yet (Serve deploys it beside the ingress, and
        a replica is only running once its engine has loaded the model) Ray answers
        `DeploymentUnavailableError`: that is waited out, not raised, so the ingress never fails its
        start-up (Serve gives a replica three tries) however slow the model is to load."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self._handle = ray_api.deployment_handle(self.deployment)
        self._cut_wait = asyncio.ensure_future(self._cut.wait())
        waited_for = ""
        while True:
            try:
                if await self.poll():
                    break
                reason = "no engine replica ready yet"
            except TimeoutError:  # a replica still loading did not answer the poll in time
                reason = "an engine replica did not answer yet"
            except Exception as exc:
                if not ray_api.is_deployment_unavailable(exc) and not ray_api.is_replica_failure(exc):
                    raise
                reason = "the engine deployment has no running replica yet"
            if reason != waited_for:
                log.info("waiting for the engine replicas: %s", reason)
                waited_for = reason
            if loop.time() - t0 > timeout:
                raise RuntimeError(f"no engine replica became ready in {timeout:.0f} s")
            await asyncio.sleep(0.2)
        log.info("engine replicas ready after %.1f s (the ingress waited for them)", loop.time() - t0)
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
        for task in (self._poller, self._cut_wait):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def begin_drain(self) -> None:
        """The start of a shutdown's grace: new requests are refused with `ServerShuttingDownError`."""
        self._draining = True

    def end_in_flight(self) -> int:
        """The end of the grace: every request in flight ends with `ServerShuttingDownError` (its Ray call
        is cancelled, which aborts its engine request). Returns how many were in flight."""
        self._draining = True
        self._cut.set()
        return self._in_flight

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, req: AddRequest) -> AsyncIterator[RequestDelta]:
        """Stream `req`'s deltas from the replica Ray picks for its adapter; see the module doc."""
        if self._draining:
            raise ServerShuttingDownError("the server is shutting down")
        if not self.healthy:
            raise EngineUnavailableError("no engine replica is ready")
        payload = encode(req)
        model_id = req.lora.digest if self.affinity and req.lora is not None else None
        self._in_flight += 1
        try:
            async for delta in self._retried(lambda attempt: self._attempt(payload, model_id, attempt)):
                yield delta
        finally:
            self._in_flight -= 1

    async def _retried(
        self, attempts: Callable[[_Attempt], AsyncIterator[T]], role: str = "engine"
    ) -> AsyncIterator[T]:
        """What `attempts(attempt)` yields, tried again (on the replica Ray picks next) when it fails with
        `_ReplicaFailed` before yielding anything: up to `retries` other replicas, and a replica that
        already failed it again after 0.2 s (Serve has not routed around it yet), within
        `retry_window_s`. A failure after the first item, or past those bounds, is `EngineDeadError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_window_s
        failed: set[str] = set()  # replicas that failed this request before its first item
        while True:
            attempt = _Attempt()
            try:
                async for item in attempts(attempt):
                    yield item
                return
            except _ReplicaFailed as exc:
                if attempt.started:
                    raise EngineDeadError(f"the {role} replica failed: {exc}") from exc
                replica = attempt.replica or f"unknown-{len(failed)}"  # died before saying who it is
                again = replica in failed
                failed.add(replica)
                if (not again and len(failed) > self.retries) or loop.time() > deadline:
                    raise EngineDeadError(f"the {role} replica failed: {exc}") from exc
                log.warning("%s replica %s failed before the first token (%s); retrying", role, replica, exc)
                if again:  # Ray has not routed around it yet (Serve's health check takes seconds)
                    await asyncio.sleep(0.2)

    async def _attempt(
        self, payload: bytes, model_id: str | None, attempt: _Attempt
    ) -> AsyncIterator[RequestDelta]:
        """One try on the replica Ray picks: its deltas; `_ReplicaFailed` when the replica or its engine
        failed; `ServerShuttingDownError` when the drain's grace ends first."""
        # the router's hot adapters per replica: each replica keeps those placed on it pinned
        call = ray_api.stream(self._handle, "generate", model_id, payload, router_stats.protected() or None)
        async with contextlib.aclosing(ray_api.iterate(call)) as items:
            while True:
                try:
                    raw = await self._next_or_cut(items)
                except StopAsyncIteration:
                    return
                except (APIError, asyncio.CancelledError, GeneratorExit, ServerShuttingDownError):
                    raise
                except Exception as exc:
                    if not ray_api.is_replica_failure(exc):
                        raise EngineUnavailableError(f"engine replica failed: {exc}") from exc
                    raise _ReplicaFailed(str(exc)) from exc
                item = decode_item(raw)
                attempt.replica = item.replica
                note_replica(item.replica)
                if item.refused is not None:
                    raise APIError(404, item.refused, param="model", code="model_not_found")
                if item.failed is not None:
                    raise _ReplicaFailed(item.failed)
                if item.delta is not None:
                    attempt.started = True
                    delta = cast(RequestDelta, decode_from_engine(item.delta))
                    yield delta
                    if delta.finish_reason is not None:
                        return

    async def _next_or_cut(self, items: AsyncIterator[Any]) -> Any:
        """The next item of a replica's stream, unless the drain's grace ends first."""
        if self._cut.is_set():
            raise ServerShuttingDownError("the shutdown grace is over")
        nxt = asyncio.ensure_future(anext(items))
        if self._cut_wait is None:
            return await nxt
        done, _ = await asyncio.wait({nxt, self._cut_wait}, return_when=asyncio.FIRST_COMPLETED)
        if nxt in done:
            return nxt.result()
        nxt.cancel()
        with contextlib.suppress(BaseException):
            await nxt
        raise ServerShuttingDownError("the shutdown grace is over")

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

    def replica_stats(self) -> list[tuple[str, EngineStatsMsg]]:
        """(replica id, its latest statistics) for every live replica that reported some."""
        return [
            (r["replica"], cast(EngineStatsMsg, decode_from_engine(r["stats"])))
            for r in self.replicas
            if r["stats"]
        ]


class _Attempt:
    """What one try of a request saw: the replica that took it, and whether a token came back."""

    __slots__ = ("replica", "started")

    def __init__(self) -> None:
        self.replica: str | None = None
        self.started = False


class _ReplicaFailed(Exception):
    """The replica, or its engine process, failed the request (retryable before the first token)."""


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
