"""The API process's handle on the engine-core process: submit, stream, abort, restart on death.

Each engine generation gets fresh ZeroMQ sockets (ipc paths in a private temp dir), so nothing queued
for a dead engine reaches its successor. A monitor task notices a dead engine, ends every in-flight
request with `EngineDeadError` (the routes answer 503), marks the client unhealthy, starts a new engine
process and becomes healthy again once it reports `Ready`.

Engine processes are forked from a `multiprocessing` forkserver that has imported the engine's modules
(torch, the engine, the tokenizer's transformers modules) once: a restart after a crash skips seconds of
imports and the new process exits without interpreter teardown. Where there is no forkserver, `spawn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from api.engine_core import run_engine_core
from api.engine_protocol import (
    AbortRequests,
    AdapterCall,
    AddRequest,
    CallResult,
    EngineStatsMsg,
    ImportRequest,
    KVEventsMsg,
    Ready,
    RequestDelta,
    Shutdown,
    decode_from_engine,
    encode,
)
from engine.engine_config import EngineConfig

log = logging.getLogger("loraplex.engine_client")

# Imported once by the forkserver (a name missing in this transformers version is skipped): what an
# engine process would otherwise import at every start, including the lazily imported modules that
# `AutoTokenizer.from_pretrained` needs for the supported architectures.
ENGINE_PRELOAD = (
    "api.engine_core",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.models.llama.configuration_llama",
    "transformers.models.mistral.configuration_mistral",
    "transformers.models.qwen2.configuration_qwen2",
    "transformers.models.qwen3.configuration_qwen3",
    "transformers.models.granite.configuration_granite",
    "transformers.models.phi3.configuration_phi3",
    "transformers.models.gemma2.configuration_gemma2",
    "transformers.models.gemma3.configuration_gemma3",
)


def engine_process_context() -> Any:
    """The multiprocessing context engine processes start from: a forkserver with `ENGINE_PRELOAD`
    imported (POSIX), else spawn. Both start from a fresh interpreter, never a fork of the API process."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(ENGINE_PRELOAD))
    return ctx


class EngineDeadError(RuntimeError):
    """The engine process died while the request was in flight."""


class EngineStalledError(EngineDeadError):
    """A step of the request's path (e.g. a disaggregated KV transfer) stalled past its timeout and was
    cancelled; retryable like a death, its message says what stalled."""


class EngineUnavailableError(RuntimeError):
    """The engine is (re)starting and cannot take requests right now."""


class ServerShuttingDownError(RuntimeError):
    """The server is shutting down: the request was cut at the end of the shutdown grace period, or came
    after it (the routes answer a retryable 503)."""


_DEAD = object()
_CUT = object()


class EngineClient:
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0) -> None:
        self.config = config
        self.startup_timeout = startup_timeout
        self.info: Ready | None = None
        self.stats: EngineStatsMsg | None = None
        # called with each `KVEventsMsg` (an engine made with `kv_events=True`; a restarted engine's
        # first message is a snapshot)
        self.on_kv_events: Callable[[KVEventsMsg], None] | None = None
        self.healthy = False
        self.restarts = 0
        self.last_start_seconds: float | None = None  # engine process start to `Ready`, last (re)start
        self._ctx = zmq.asyncio.Context()
        self._tmp = tempfile.TemporaryDirectory(prefix="loraplex-ipc-")
        self._generation = itertools.count()
        self._call_ids = itertools.count(1)
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._proc: mp.process.BaseProcess | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._died = asyncio.Event()  # set when the current engine process is found dead
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._cut = False  # set by `end_in_flight`: requests are refused from then on

    # ---- life cycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until it has loaded the model."""
        await self._spawn()
        self._tasks.append(asyncio.create_task(self._monitor(), name="engine-monitor"))

    async def _spawn(self) -> None:
        gen = next(self._generation)
        base = Path(self._tmp.name)
        in_addr, out_addr = f"ipc://{base}/in-{gen}", f"ipc://{base}/out-{gen}"
        self._died = asyncio.Event()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(out_addr)
        proc = engine_process_context().Process(
            target=run_engine_core,
            args=(self.config, in_addr, out_addr),
            kwargs={"api_pid": os.getpid()},
            name="loraplex-engine",
            daemon=True,
        )
        t0 = time.monotonic()
        proc.start()
        self._proc = proc
        try:
            ready = await asyncio.wait_for(self._wait_ready(proc, self._pull), self.startup_timeout)
        except (TimeoutError, EngineDeadError) as exc:
            raise RuntimeError(f"engine process failed to start (exit code {proc.exitcode})") from exc
        self.last_start_seconds = time.monotonic() - t0
        log.info("engine process %s ready in %.2fs", proc.pid, self.last_start_seconds)
        self.info = ready
        self.healthy = True
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self._reader(self._pull), name=f"engine-reader-{gen}"))

    async def _wait_ready(self, proc, pull: zmq.asyncio.Socket) -> Ready:
        while True:
            if await pull.poll(200):
                msg = decode_from_engine(await pull.recv())
                if isinstance(msg, Ready):
                    return msg
            elif not proc.is_alive():
                raise EngineDeadError("engine exited during start-up")

    async def _reader(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                msg = decode_from_engine(await sock.recv())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if isinstance(msg, RequestDelta):
                q = self._queues.get(msg.request_id)
                if q is not None:
                    q.put_nowait(msg)
            elif isinstance(msg, CallResult):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, EngineStatsMsg):
                self.stats = msg
            elif isinstance(msg, KVEventsMsg) and self.on_kv_events is not None:
                self.on_kv_events(msg)

    async def _monitor(self) -> None:
        while not self._closing:
            await asyncio.sleep(0.2)
            if self._closing or self._proc is None or self._proc.is_alive():
                continue
            log.error("engine process died (exit code %s); restarting", self._proc.exitcode)
            self.healthy = False
            self._died.set()
            self._fail_in_flight()
            for sock in (self._push, self._pull):
                if sock is not None:
                    sock.close(linger=0)
            while not self._closing:
                try:
                    await self._spawn()
                    self.restarts += 1
                    log.warning("engine process restarted; ready in %.2fs", self.last_start_seconds)
                    break
                except RuntimeError:
                    log.exception("engine restart failed; retrying")
                    await asyncio.sleep(1.0)

    def end_in_flight(self) -> int:
        """End every request in flight with `ServerShuttingDownError` (their engine requests are aborted)
        and refuse new ones: the end of a shutdown's grace period. Returns how many were in flight."""
        self._cut = True
        for q in self._queues.values():
            q.put_nowait(_CUT)
        return len(self._queues)

    def _fail_in_flight(self) -> None:
        for q in self._queues.values():
            q.put_nowait(_DEAD)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError("engine process died"))
        self._calls.clear()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, wait for it, then release sockets."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                if self._push is not None:  # bound whenever a process was started
                    await self._push.send(encode(Shutdown()))
            for _ in range(int(timeout / 0.1)):
                if not proc.is_alive():
                    break
                await asyncio.sleep(0.1)
            if proc.is_alive():
                proc.kill()
        self._fail_in_flight()
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, req: AddRequest) -> AsyncIterator[RequestDelta]:
        """Submit `req` and yield its deltas until it finishes. Leaving early aborts it in the engine."""
        async for delta in self.stream(req.request_id, encode(req)):
            yield delta

    async def import_generate(self, request_id: str, export: bytes) -> AsyncGenerator[RequestDelta, None]:
        """Continue another engine's prefill-only request (`export`: its encoded `KVExport`) here, as
        `generate` does a new one: its deltas after the transferred tokens."""
        async for delta in self.stream(request_id, encode(ImportRequest(request_id, export))):
            yield delta

    async def stream(self, request_id: str, message: bytes) -> AsyncIterator[RequestDelta]:
        """Send `message` (an encoded `AddRequest` or `ImportRequest` for `request_id`) and yield the
        request's deltas until it finishes. Leaving early aborts it in the engine."""
        if self._cut:
            raise ServerShuttingDownError("the server is shutting down")
        if not self.healthy:
            raise EngineUnavailableError("the engine is restarting")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        try:
            await self._send(message)
            while True:
                delta = await q.get()
                if delta is _DEAD:
                    raise EngineDeadError("engine process died")
                if delta is _CUT:
                    raise ServerShuttingDownError("the server is shutting down")
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.healthy:
                with contextlib.suppress(zmq.ZMQError):
                    await self.abort([request_id])

    async def _send(self, data: bytes) -> None:
        """Send one message to the current engine; `EngineDeadError` if it is found dead first. (A PUSH
        socket whose peer is gone blocks a send, and the monitor closes it under the sender; without
        this, a request sent in the moment between the engine's death and its detection would hang.)"""
        sock, died = self._push, self._died
        if died.is_set() or sock is None:
            raise EngineDeadError("engine process died")
        send = asyncio.ensure_future(sock.send(data))
        if not send.done():
            dead = asyncio.ensure_future(died.wait())
            try:
                await asyncio.wait({send, dead}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                dead.cancel()
        if not send.done() or died.is_set():
            send.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await send
            raise EngineDeadError("engine process died")
        send.result()

    async def abort(self, request_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):
            await self._send(encode(AbortRequests(request_ids)))

    async def adapter_call(
        self,
        op: str,
        name: str,
        path: str | None = None,
        digest: str | None = None,
        timeout: float = 120.0,
        keep: Iterable[str] = (),
    ) -> Any:
        """Run an adapter operation in the engine ("add", "prefetch", "remove", "pin", "unpin"); raises
        on failure. `keep` (for "remove"): digests other active names still serve."""
        if not self.healthy:
            raise EngineUnavailableError("the engine is restarting")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self._send(encode(AdapterCall(call_id, op, name, path, digest, sorted(keep))))
        except EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        result: CallResult = await asyncio.wait_for(fut, timeout)
        if not result.ok:
            raise ValueError(result.error)
        return result.value

    def num_in_flight(self) -> int:
        return len(self._queues)
