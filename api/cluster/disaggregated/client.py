"""`DisaggregatedClient`: the ingress's engine client with separate prefill and decode deployments.

One request (`generate`): a prompt of at most `local_prefill_tokens` tokens runs whole on a decode replica
(`generate` there, routed as `prepare` is; retried like a prefill), with no handoff. Any other: the
prefill deployment runs it prefill-only (retried once on another replica
if it fails before its first token, as `RemoteEngineClient` does); at the same time `prepare` asks the
decode deployment's router for a replica and makes the adapter resident there. The first token is
yielded as soon as the prefill samples it; the prefill's `Handoff` then goes to `decode` on the prepared
replica, whose deltas follow. After the first token any failure (the prefill replica dying before its
handoff, the decode replica or its engine dying, the transfer stalling past `transfer_timeout_s`) ends
the request with `EngineDeadError`: the routes answer the retryable 503 (an SSE error event in a stream).
Leaving early cancels the Ray calls, which aborts the engine requests on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import msgspec

from api.cluster import ray_api
from api.cluster.disaggregated.handoff import Handoff
from api.cluster.disaggregated.metrics import KVTransferMetrics
from api.cluster.remote_client import RemoteEngineClient, _Attempt, _ReplicaFailed, merge_stats
from api.cluster.replica import decode_item
from api.cluster.replica_header import note_replica
from api.engine_client import (
    EngineDeadError,
    EngineStalledError,
    EngineUnavailableError,
    ServerShuttingDownError,
)
from api.engine_protocol import AddRequest, EngineStatsMsg, Ready, RequestDelta, decode_from_engine, encode
from api.errors import APIError
from engine.engine_config import EngineConfig

log = logging.getLogger("loraplex.disaggregated")
# how long the ingress waits for a decode replica to make an adapter resident (`prepare`, or the decode
# call itself): the engine client's bound on one adapter call
ADAPTER_LOAD_TIMEOUT_S = 120.0


class DisaggregatedClient(RemoteEngineClient):
    def __init__(
        self,
        config: EngineConfig,
        prefill: str,
        decode: str,
        transfer_timeout_s: float = 30.0,
        local_prefill_tokens: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, prefill, affinity=False, **kwargs)
        self.decode_deployment = decode
        self.transfer_timeout_s = transfer_timeout_s
        self._releases: set[asyncio.Future] = set()  # `_release` calls in flight
        self.local_prefill_tokens = local_prefill_tokens
        self.kv_metrics = KVTransferMetrics()
        self._decode_handle: Any = None
        self._phase = {"prefill": 0, "transfer": 0, "decode": 0}

    async def start(self, timeout: float = 1800.0) -> None:
        self._decode_handle = ray_api.deployment_handle(self.decode_deployment)
        await super().start(timeout)

    async def poll(self) -> bool:
        """Refresh from every replica of both deployments; ready once each deployment has one ready."""
        if self._handle is None:
            self._handle = ray_api.deployment_handle(self.deployment)
        pre, dec = await asyncio.gather(
            ray_api.broadcast(self._handle, "describe", timeout_s=5.0),
            ray_api.broadcast(self._decode_handle, "describe", timeout_s=5.0),
        )
        replicas = [r for r in (*pre, *dec) if isinstance(r, dict)]
        ready = {r.get("role") for r in replicas if r["healthy"] and r["info"] is not None}
        self.replicas = replicas
        first = next((r for r in replicas if r["info"] is not None), None)
        if first is not None and self.info is None:
            self.info = cast(Ready, decode_from_engine(first["info"]))
        self.healthy = {"prefill", "decode"} <= ready
        self.restarts = sum(r["restarts"] for r in replicas)
        stats = [cast(EngineStatsMsg, decode_from_engine(r["stats"])) for r in replicas if r["stats"]]
        self.stats = merge_stats(stats)
        self.kv_metrics.refresh_phases(replicas)
        return self.healthy

    def bind_metrics(self, registry: Any) -> None:
        """Add the KV-transfer metrics to the server's `/metrics` (called at each scrape; binds once)."""
        self.kv_metrics.bind(registry)

    def _enter(self, phase: str) -> None:
        self._phase[phase] += 1
        self.kv_metrics.phase.labels(phase).set(self._phase[phase])

    def _leave(self, phase: str) -> None:
        self._phase[phase] -= 1
        self.kv_metrics.phase.labels(phase).set(self._phase[phase])

    # ---- one request ------------------------------------------------------------------------------
    async def generate(self, req: AddRequest) -> AsyncIterator[RequestDelta]:
        if self._draining:
            raise ServerShuttingDownError("the server is shutting down")
        if not self.healthy:
            raise EngineUnavailableError("no prefill or no decode replica is ready")
        lora = req.lora
        digest = lora.digest if lora is not None and lora.digest and not lora.mix else ""
        name = lora.name if lora is not None else ""
        members = [(m.digest, m.name) for m, _ in lora.mix if m.digest] if lora is not None else []
        if self.local_prefill_tokens and len(req.prompt_token_ids) <= self.local_prefill_tokens:
            async for delta in self._whole(req, digest):
                yield delta
            return
        prepared = asyncio.ensure_future(ray_api.call(self._decode_handle, "prepare", digest, name, members))
        self._in_flight += 1
        phase = ["prefill"]  # the request's phase now, for the per-phase gauge

        def move(to: str) -> None:
            self._leave(phase[0])
            phase[0] = to
            self._enter(to)

        self._enter(phase[0])
        try:
            handoff: Handoff | None = None
            async for out in self._prefill(req):
                if isinstance(out, Handoff):
                    handoff = out
                    continue  # the prefill's stream ends right after it
                yield out
                if out.finish_reason is not None:
                    return
            if handoff is None:
                raise EngineDeadError("the prefill replica ended the request without its KV")
            move("transfer")
            target = await self._prepared(prepared)
            async for delta in self._decode(target, handoff, digest, lambda: move("decode")):
                yield delta
        except EngineDeadError as exc:
            log.warning("request %s failed in its %s phase: %s", req.request_id, phase[0], exc)
            raise
        finally:
            prepared.cancel()
            self._leave(phase[0])
            self._in_flight -= 1

    async def _whole(self, req: AddRequest, digest: str) -> AsyncIterator[RequestDelta]:
        """A short prompt's request, prefill and decode, on one decode replica (no KV handoff)."""
        self._in_flight += 1
        self._enter("decode")
        try:
            async for out in self._prefill(req, local=digest):
                assert not isinstance(out, Handoff)
                yield out
        finally:
            self._leave("decode")
            self._in_flight -= 1

    async def _prepared(self, prepared: asyncio.Future) -> str:
        """The decode replica prepared for the request ("" when preparing failed: any replica, which then
        loads the adapter itself)."""
        try:
            out = await asyncio.wait_for(asyncio.shield(prepared), ADAPTER_LOAD_TIMEOUT_S)
        except Exception as exc:
            log.warning("preparing a decode replica failed (%s); the decode router picks one", exc)
            return ""
        if out.get("refused"):
            raise EngineDeadError(f"the decode replica refused the adapter: {out['refused']}")
        return "" if out.get("failed") else str(out["replica"])

    async def _prefill(
        self, req: AddRequest, local: str | None = None
    ) -> AsyncIterator[RequestDelta | Handoff]:
        """The prefill's first token delta and its handoff (or a finished delta), retried once on another
        replica if one fails before the first token. `local` (the adapter digest, "" for none): the whole
        request on a decode replica instead, all its deltas."""
        payload = encode(req if local is not None else msgspec.structs.replace(req, prefill_only=True))
        role = "prefill" if local is None else "decode"
        async for out in self._retried(lambda attempt: self._prefill_attempt(payload, attempt, local), role):
            yield out

    async def _prefill_attempt(
        self, payload: bytes, attempt: _Attempt, local: str | None = None
    ) -> AsyncIterator[RequestDelta | Handoff]:
        if local is None:
            call = ray_api.stream(self._handle, "generate", None, payload)
        else:  # the whole request on a decode replica
            call = ray_api.stream(self._decode_handle, "generate", None, local, payload)
        async with contextlib.aclosing(ray_api.iterate(call)) as items:
            while True:
                # once the first token is out, the handoff must follow within the transfer timeout; the
                # first token itself has no bound here (a long prompt's prefill, a queue under load or a
                # cold adapter load may take longer than any transfer)
                timeout = self.transfer_timeout_s if attempt.started and local is None else None
                try:
                    raw = await self._next(items, timeout, _ReplicaFailed)
                except TimeoutError:
                    self.kv_metrics.transfers.labels("timeout").inc()
                    raise EngineStalledError(
                        f"the prefill replica did not hand the KV over within {timeout:g} s; it was cancelled"
                    ) from None
                if raw is None:
                    return
                if isinstance(raw, Handoff):
                    # read the stream to its end: cancelling it would let the prefill replica drop the
                    # blocks' objects before this process is registered as borrowing them
                    try:
                        while await self._next(items, self.transfer_timeout_s, _ReplicaFailed) is not None:
                            pass
                    except TimeoutError:
                        raise EngineDeadError("the prefill replica did not end its stream") from None
                    yield raw
                    return
                delta = self._delta(raw, attempt, _ReplicaFailed)
                if delta is not None:
                    yield delta
                    if delta.finish_reason is not None:
                        return

    async def _decode(
        self, target: str, handoff: Handoff, digest: str, on_transferred: Callable[[], None]
    ) -> AsyncIterator[RequestDelta]:
        """The decode replica's deltas for `handoff`; `EngineDeadError` on any failure (a token was sent)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        attempt = _Attempt()
        transferred = fetching = False
        call = ray_api.stream(self._decode_handle, "decode", None, target, handoff, digest)
        async with contextlib.aclosing(ray_api.iterate(call)) as items:
            while True:
                # the decode replica times its own transfer; this bounds a replica that stops answering
                # (an adapter it still has to load gets the adapter-load bound first)
                timeout = None if transferred else self.transfer_timeout_s + 5.0
                if not fetching:
                    timeout = ADAPTER_LOAD_TIMEOUT_S
                try:
                    raw = await self._next(items, timeout, EngineDeadError)
                except TimeoutError:
                    self.kv_metrics.transfers.labels("timeout").inc()
                    what = "the KV transfer to" if fetching else "loading the adapter on"
                    raise EngineStalledError(
                        f"{what} the decode replica did not complete within {timeout:g} s; it was cancelled"
                    ) from None
                except EngineDeadError:
                    if not transferred:
                        self.kv_metrics.transfers.labels("failed").inc()
                    raise
                if raw is None:
                    raise EngineDeadError("the decode replica ended the request early")
                if isinstance(raw, dict) and "fetching" in raw:  # its adapter is resident; the fetch begins
                    fetching = True
                    continue
                if isinstance(raw, dict) and "timeout" in raw:  # the decode replica gave up: stalled
                    self.kv_metrics.transfers.labels("timeout").inc()
                    raise EngineStalledError(str(raw["timeout"]))
                if isinstance(raw, dict):  # the decode replica's engine holds the request and its blocks
                    transferred = True
                    self.kv_metrics.transfers.labels("ok").inc()
                    self.kv_metrics.bytes.inc(int(raw.get("bytes", 0)))
                    self.kv_metrics.seconds.observe(loop.time() - t0)
                    on_transferred()
                    self._release(handoff)
                    continue
                try:
                    delta = self._delta(raw, attempt, EngineDeadError)
                except EngineDeadError:
                    if not transferred:
                        self.kv_metrics.transfers.labels("failed").inc()
                    raise
                if delta is not None:
                    yield delta
                    if delta.finish_reason is not None:
                        return

    def _release(self, handoff: Handoff) -> None:
        """Tell the prefill replicas that `handoff`'s blocks are imported: the one holding its chunks'
        refs drops them now rather than after the transfer timeout (in the background; a lost message
        leaves that timeout as the bound)."""
        task = asyncio.ensure_future(ray_api.broadcast(self._handle, "release_handoff", 10.0, handoff.key))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    # ---- stream items -----------------------------------------------------------------------------
    async def _next(self, items: AsyncIterator[Any], timeout: float | None, failure: type[Exception]) -> Any:
        """The next item (None at the end), unless the drain's grace ends first (`ServerShuttingDownError`)
        or `timeout` passes (`TimeoutError`); a dead replica raises `failure`."""
        if self._cut.is_set():
            raise ServerShuttingDownError("the shutdown grace is over")
        nxt = asyncio.ensure_future(anext(items))
        waits: set[asyncio.Future] = {nxt}
        if self._cut_wait is not None:
            waits.add(self._cut_wait)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
            if self._cut.is_set():
                raise ServerShuttingDownError("the shutdown grace is over")
            raise TimeoutError
        try:
            return nxt.result()
        except StopAsyncIteration:
            return None
        except (APIError, asyncio.CancelledError, GeneratorExit, ServerShuttingDownError):
            raise
        except Exception as exc:
            if not ray_api.is_replica_failure(exc):
                raise EngineUnavailableError(f"engine replica failed: {exc}") from exc
            raise failure(f"the replica died: {exc}") from exc

    def _delta(self, raw: bytes, attempt: _Attempt, failure: type[Exception]) -> RequestDelta | None:
        item = decode_item(raw)
        attempt.replica = item.replica
        note_replica(item.replica)
        if item.refused is not None:
            raise APIError(404, item.refused, param="model", code="model_not_found")
        if item.failed is not None:
            raise failure(item.failed)
        if item.delta is None:
            return None
        attempt.started = True
        return cast(RequestDelta, decode_from_engine(item.delta))
