"""The engine-core process: owns the `LLMEngine` and runs its step loop, fed over ZeroMQ.

Loop: drain incoming messages (without waiting while there is work), `engine.step()`, send each
request's new tokens as a `RequestDelta`, and every `stats_interval` seconds an `EngineStatsMsg`.
A request whose grammar is not compiled yet waits in `compiling` while a worker thread compiles it, and
is queued on the loop's first turn after that (a hard grammar never stalls the other requests' steps).
Detokenization and stop strings are the API process's job; the engine returns token ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from api.engine_protocol import (
    AbortRequests,
    AdapterCall,
    AddRequest,
    CallResult,
    EngineStatsMsg,
    ImportRequest,
    InvalidMessage,
    KVEventsMsg,
    Ready,
    RequestDelta,
    Shutdown,
    decode_to_engine,
    encode,
)
from engine import LLMEngine, LoRARequest
from engine.distributed.worker_group import WorkerGroupError
from engine.engine_config import EngineConfig
from engine.engine_kv_transfer import PendingImport
from engine.kv_transfer.state import decode_export, encode_export
from engine.lora.held_files import AdapterFilesGone
from engine.model.cpu_gemm import bound_onednn_caches
from engine.outputs import RequestOutput
from engine.structured import StructuredSpecError

log = logging.getLogger("loraplex.engine_core")
COMPILE_POLL_MS = 5  # how often an otherwise idle loop looks for finished grammar compiles and KV copies


def run_engine_core(
    config: EngineConfig,
    in_addr: str,
    out_addr: str,
    stats_interval: float = 0.5,
    api_pid: int | None = None,
) -> None:
    """Process entry point: load the model, announce `Ready`, then serve until `Shutdown`.

    Terminal signals sent to the whole process group (Ctrl-C, `timeout`) are ignored: the API process
    decides when the engine stops. If the API process (`api_pid`, default: the parent) dies, the engine
    notices and exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch = _ParentWatch(api_pid if api_pid is not None else os.getppid())
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    bound_onednn_caches()  # before the model's first oneDNN call
    engine: LLMEngine | None = None
    try:
        engine = LLMEngine(dataclasses.replace(config, detokenize=False))
        # A failed tensor-parallel worker group ends this process (its workers killed): the API process
        # then fails the requests in flight with its retryable 503, reports unhealthy and starts a new
        # engine, whose group starts afresh.
        engine.recover_worker_group = False
        graphs = engine.runner.graphs.stats if engine.runner.graphs is not None else None
        push.send(
            encode(
                Ready(
                    max_model_len=engine.model_config.max_model_len,
                    num_kv_blocks=engine.num_kv_blocks,
                    block_size=config.block_size,
                    vocab_size=engine.model_config.vocab_size,
                    device=str(engine.device),
                    dtype=str(engine.dtype).removeprefix("torch."),
                    lora_backend=engine.lora.backend if engine.lora else "",
                    lora_dtype=str(engine.lora.pool.dtype).removeprefix("torch.") if engine.lora else "",
                    dtype_reason=engine.dtype_reason,
                    cuda_graphs=graphs.graphs if graphs else 0,
                    graph_capture_s=graphs.capture_s if graphs else 0.0,
                    graph_memory_bytes=graphs.memory_bytes if graphs else 0,
                )
            )
        )
        _EngineLoop(engine, pull, push, stats_interval, watch).run()
    finally:
        if engine is not None:
            engine.shutdown()
        watch.close()
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


class _ParentWatch:
    """Whether the API process is still alive: a pidfd where Linux has one (immune to pid reuse), else a
    signal-0 probe. The engine's direct parent may be a forkserver, so the API's pid is watched."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # no pidfd_open: not Linux >= 5.3
            self._fd = os.pidfd_open(pid)

    def alive(self) -> bool:
        if self._fd is not None:
            return not select.select([self._fd], [], [], 0)[0]  # readable once the process exited
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _EngineLoop:
    def __init__(self, engine: LLMEngine, pull, push, stats_interval: float, watch: _ParentWatch) -> None:
        self.engine, self.pull, self.push = engine, pull, push
        self.stats_interval = stats_interval
        self.sent: dict[str, int] = {}  # request id -> tokens already sent
        self.running = True
        self.watch = watch
        # waiting for their grammar
        self.compiling: dict[str, tuple[Future[None], AddRequest | ImportRequest]] = {}
        # imports whose K/V blocks a worker thread is filling while steps go on (`_finish_imports`)
        self.importing: dict[str, PendingImport] = {}
        self.cancelled_imports: list[PendingImport] = []  # aborted mid-copy: freed once the copy ends
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="kv-import")

    def run(self) -> None:
        try:
            self._serve()
        finally:  # no copy may write into the cache after the engine is gone
            self.copier.shutdown(wait=True, cancel_futures=True)

    def _serve(self) -> None:
        next_stats = 0.0
        while self.running:
            if not self.watch.alive():  # orphaned: the API process is gone
                return
            busy = self.engine.has_unfinished_requests()
            waiting = self.compiling or self.importing or self.cancelled_imports
            timeout = 0 if busy else (COMPILE_POLL_MS if waiting else 20)
            while self.pull.poll(timeout):
                self._receive(self.pull.recv())
                timeout = 0
            if not self.running:
                break
            if self.compiling:
                self._queue_compiled()
            if self.importing or self.cancelled_imports:
                self._finish_imports()
            if self.engine.has_unfinished_requests():
                self._step()
            now = time.monotonic()
            if now >= next_stats:
                self._send_stats()
                next_stats = now + self.stats_interval

    def _step(self) -> None:
        """One engine step. Per-request failures come back as outputs with `error`; should the step
        itself raise, the requests in flight end with an error and the loop (and process) goes on."""
        try:
            outputs = self.engine.step()
        except WorkerGroupError:
            raise  # ends the process (`run_engine_core`)
        except Exception as exc:
            log.exception("engine step failed; ending the requests in flight")
            ids = list(self.sent)
            self.engine.abort_request(ids)
            for rid in ids:
                self.sent.pop(rid, None)
                self._refuse(rid, f"engine step failed: {exc!r}")
            return
        for out in outputs:
            self._send_delta(out)

    def _receive(self, data: bytes) -> None:
        """Decode and handle one message; one that breaks the contract is refused (if it names a request)
        or dropped, and the loop goes on."""
        try:
            msg = decode_to_engine(data)
        except InvalidMessage as exc:
            log.warning("refused a malformed message: %s", exc)
            if exc.request_id is not None:
                self._refuse(exc.request_id, f"invalid request: {exc}", status=400)
            return
        self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, ImportRequest):
            self._import(msg)
        elif isinstance(msg, AbortRequests):
            self.engine.abort_request(msg.request_ids)
            for rid in msg.request_ids:
                self.sent.pop(rid, None)
                self.compiling.pop(rid, None)
                pending = self.importing.pop(rid, None)
                if pending is not None:
                    self.cancelled_imports.append(pending)
        elif isinstance(msg, AdapterCall):
            self._adapter_call(msg)
        elif isinstance(msg, Shutdown):
            self.running = False

    def _add(self, msg: AddRequest) -> None:
        """Queue `msg`'s request, or, when its grammar needs compiling, start that in a worker thread
        and queue it later (`_queue_compiled`)."""
        if msg.request_id not in self.compiling:
            pending = self.engine.structured.compile_later(msg.params)
            if pending is not None:
                self.compiling[msg.request_id] = (pending, msg)
                return
        self._add_now(msg)

    def _queue_compiled(self) -> None:
        """Queue the requests whose grammar finished compiling; refuse (400) those it failed for."""
        done = [rid for rid, (fut, _) in self.compiling.items() if fut.done()]
        for rid in done:
            fut, msg = self.compiling.pop(rid)
            exc = fut.exception()
            if isinstance(exc, StructuredSpecError):
                self._refuse(rid, str(exc), status=400)
            elif exc is not None:
                log.error("grammar compile failed for %s: %r", rid, exc)
                self._refuse(rid, f"request failed in the engine: {exc!r}")
            elif isinstance(msg, ImportRequest):
                self._import(msg)
            else:
                self._add_now(msg)

    def _add_now(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                msg.lora,
                msg.priority,
                prefill_only=msg.prefill_only,
            )
            self.sent[msg.request_id] = 0
        except AdapterFilesGone as exc:  # deleted before this request reached the engine: as if inactive
            self._refuse(msg.request_id, str(exc), status=404)
        except ValueError as exc:  # refused by the engine's own checks
            self._refuse(msg.request_id, str(exc), status=400)
        except Exception as exc:  # a request that breaks add_request ends itself, never the loop
            log.exception("add_request failed for %s", msg.request_id)
            self._refuse(msg.request_id, f"request failed in the engine: {exc!r}")

    def _import(self, msg: ImportRequest) -> None:
        """Continue a prefill-only request of another engine (its KV and state in `msg.export`): its
        blocks are reserved now and filled in the copier thread; `_finish_imports` queues it."""
        rid = msg.request_id
        with self._import_errors(rid):
            export = decode_export(msg.export)
            if export.state.request_id != rid:
                raise ValueError("the export belongs to another request")
            if rid in self.importing:
                raise ValueError(f"request id {rid!r} is already in use")
            if rid not in self.compiling:  # its grammar compiles in a worker thread first
                pending = self.engine.structured.compile_later(export.state.params)
                if pending is not None:
                    self.compiling[rid] = (pending, msg)
                    return
            self.importing[rid] = self.engine.begin_import(export, self.copier)
            self._finish_imports()  # an inline copy (device cache, no room) is done already

    def _finish_imports(self) -> None:
        """Queue the imports whose blocks are filled, acknowledging each (the sender may drop its copy
        now); end those aborted meanwhile, freeing their blocks."""
        for rid in [r for r, p in self.importing.items() if p.done()]:
            pending = self.importing.pop(rid)
            with self._import_errors(rid):
                self.engine.finish_import(pending)
                self.sent[rid] = len(pending.seq.output_token_ids)  # the prefill side sent those
                self.push.send(encode(RequestDelta(rid, [], imported=True)))  # the import's ack
        for pending in [p for p in self.cancelled_imports if p.done()]:
            self.cancelled_imports.remove(pending)
            with contextlib.suppress(Exception):  # nobody waits for it: only the blocks matter
                self.engine.finish_import(pending)  # queued as any request, then ended with its holds
                self.engine.abort_request(pending.seq.seq_id)

    @contextlib.contextmanager
    def _import_errors(self, rid: str):
        """Refuse import `rid` with the status its failure calls for; the loop goes on."""
        try:
            yield
        except AdapterFilesGone as exc:
            self._refuse(rid, str(exc), status=404)
        except ValueError as exc:
            self._refuse(rid, str(exc), status=400)
        except Exception as exc:
            log.exception("import_request failed for %s", rid)
            self._refuse(rid, f"request failed in the engine: {exc!r}")

    def _refuse(self, request_id: str, error: str, status: int = 500) -> None:
        delta = RequestDelta(request_id, [], finish_reason="error", error=error, error_status=status)
        self.push.send(encode(delta))

    def _send_delta(self, out: RequestOutput) -> None:
        comp = out.outputs[0]
        start = self.sent.get(out.request_id, 0)
        new = comp.token_ids[start:]
        lps = None
        if comp.logprobs is not None:
            lps = [
                sorted(((t, lp.logprob, lp.rank) for t, lp in entry.items()), key=lambda e: e[0] != tok)
                for tok, entry in zip(new, comp.logprobs[start:], strict=True)
            ]
        finish = comp.finish_reason if out.finished else None
        if out.error:
            finish = "error"
        kv = encode_export(out.kv_export) if out.kv_export is not None else None
        self.push.send(
            encode(
                RequestDelta(
                    out.request_id,
                    new,
                    lps,
                    finish,
                    out.num_cached_tokens,
                    out.error,
                    error_status=400 if out.refused else 500,
                    kv_export=kv,
                )
            )
        )
        if out.kv_export is not None:  # the bytes are on their way: the sending side holds nothing more
            self.engine.release_kv_transfer(out.request_id)
        if out.finished:
            self.sent.pop(out.request_id, None)
        else:
            self.sent[out.request_id] = len(comp.token_ids)

    def _adapter_call(self, msg: AdapterCall) -> None:
        eng = self.engine
        try:
            value: Any = None
            if msg.op == "add":
                value = eng.add_lora(LoRARequest(msg.name, msg.path or "", msg.digest))
            elif msg.op == "prefetch":
                eng.prefetch_lora(LoRARequest(msg.name, msg.path or "", msg.digest))
            elif msg.op == "remove":
                value = eng.remove_lora(msg.name, keep=set(msg.keep))
            elif msg.op in ("pin", "unpin"):
                value = eng.pin_lora(msg.name, msg.op == "pin")
            else:
                raise ValueError(f"unknown adapter op {msg.op!r}")
            self.push.send(encode(CallResult(msg.call_id, True, value)))
        except Exception as exc:  # reported to the caller, never fatal to the loop
            self.push.send(encode(CallResult(msg.call_id, False, error=str(exc))))

    def _send_stats(self) -> None:
        eng = self.engine
        events = eng.take_kv_events()
        if events is not None:
            self.push.send(encode(KVEventsMsg(events.reset, events.stored, events.removed)))
        lora = dataclasses.asdict(eng.get_lora_stats()) if eng.lora is not None else None
        adapters = [dataclasses.asdict(a) for a in eng.list_loras()] if eng.lora is not None else []
        self.push.send(encode(EngineStatsMsg(dataclasses.asdict(eng.get_stats()), lora, adapters)))
