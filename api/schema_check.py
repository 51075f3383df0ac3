"""`SchemaChecker`: compiles a request's schemas off the event loop, bounded, cached, within a budget.

A 62 KiB schema takes llguidance about a second to compile, so compiling on the event loop froze the
whole API (`/health` included) for as long as a request's tools took. Here each `SchemaJob` is compiled
in a small thread pool (llguidance releases the GIL), exactly as the engine will compile it (the model's
tokenizer, the same limits, the same dry run of the first tokens: `GrammarCompiler`), so what llguidance
refuses is a 400 naming the field before the request is queued. Results, success or refusal, are cached
by the spec's hash; a spec being compiled for one request is awaited, not compiled again, by another.

Bounds: one request's jobs run one after another (a request never holds more than one worker), within
`budget_seconds` of compile time in all (past it: 400, the schemas are too costly; time spent waiting
for a worker does not count); at most `max_pending` distinct specs wait or compile at once, and a spec
waits at most `queue_seconds` for a worker (past either: 503, retry). Routes call `check` only once the
request passed its size checks and rate limits, so the compile is paid for by the caller's own limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from api.errors import APIError
from api.structured import SchemaJob
from engine.structured import StructuredSpecError
from engine.structured.compiler import GrammarCompiler, check_spec

WORKERS = 2
BUDGET_SECONDS = 10.0  # compile time one request may use, all its schemas together
MAX_PENDING = 64  # distinct specs compiling or waiting for a worker
QUEUE_SECONDS = 30.0  # most a spec waits for a worker before its request is told to retry (503)
CACHE_SIZE = 1024  # results kept (LRU)

Key = tuple[str, bool]


class SchemaChecker:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        workers: int = WORKERS,
        budget_seconds: float = BUDGET_SECONDS,
        max_pending: int = MAX_PENDING,
        queue_seconds: float = QUEUE_SECONDS,
    ) -> None:
        """`tokenizer`: the model's HF tokenizer (None: constrained specs are only compiled, the engine
        refuses them); `vocab_size`: the engine's logits width."""
        eos_id = getattr(tokenizer, "eos_token_id", None)
        eos = (eos_id,) if eos_id is not None else ()
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos) if tokenizer is not None else None
        self.budget_seconds, self.max_pending = budget_seconds, max_pending
        self.queue_seconds = queue_seconds
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="loraplex-schema")
        self._results: OrderedDict[Key, str | None] = OrderedDict()  # None: compiles; else the reason
        self._pending: dict[Key, tuple[Future[str | None], asyncio.Future[None]]] = {}  # + started
        self.compiles = 0  # specs compiled (cache misses), for tests and metrics

    async def check(self, jobs: Sequence[SchemaJob]) -> None:
        """Compile every job (cached); 400 naming the first job's field whose spec is refused, or when
        the request's compile budget runs out; 503 when too many specs are already compiling, or a job
        waited `queue_seconds` for a worker."""
        budget = [self.budget_seconds]  # compile time left to this request (waiting for a worker is free)
        for job in jobs:
            reason = await self._result(job, budget)
            if reason is not None:
                raise APIError(400, f"{job.param}: {reason}", param=job.param)

    async def _result(self, job: SchemaJob, budget: list[float]) -> str | None:
        key = (job.spec.key, job.constrains and self.compiler is not None)
        if key in self._results:
            self._results.move_to_end(key)
            return self._results[key]
        entry = self._pending.get(key)
        if entry is None:
            if len(self._pending) >= self.max_pending:
                raise _busy()
            loop = asyncio.get_running_loop()
            started: asyncio.Future[None] = loop.create_future()
            fut = self._pool.submit(self._compile, job, key[1], lambda: _call_soon(loop, _set, started))
            self.compiles += 1
            entry = self._pending[key] = (fut, started)
            fut.add_done_callback(lambda f: _call_soon(loop, self._store, key, f))
        fut, started = entry
        try:
            await asyncio.wait_for(asyncio.shield(started), self.queue_seconds)
        except TimeoutError:
            raise _busy() from None
        t0 = time.monotonic()
        try:
            waiting = asyncio.shield(asyncio.wrap_future(fut))
            return await asyncio.wait_for(waiting, max(budget[0], 0.0))
        except TimeoutError:
            raise APIError(
                400,
                f"{job.param}: compiling this request's schemas took over {self.budget_seconds:g} s; "
                "simplify them",
                param=job.param,
            ) from None
        finally:
            budget[0] -= time.monotonic() - t0

    def _compile(self, job: SchemaJob, with_tokenizer: bool, on_start: Callable[[], None]) -> str | None:
        """None when `job.spec` compiles (and, `with_tokenizer`, passes its dry run), else the reason."""
        on_start()
        try:
            if with_tokenizer:
                assert self.compiler is not None
                self.compiler.compile(job.spec)
            else:
                check_spec(job.spec)
        except StructuredSpecError as exc:
            return str(exc)
        except (ValueError, TypeError, RecursionError) as exc:  # llguidance refused it some other way
            return f"invalid {job.spec.kind}: {exc}"
        return None

    def _store(self, key: Key, fut: Future[str | None]) -> None:
        self._pending.pop(key, None)
        if fut.cancelled() or fut.exception() is not None:
            return
        self._results[key] = fut.result()
        while len(self._results) > CACHE_SIZE:
            self._results.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _busy() -> APIError:
    return APIError(
        503,
        "the schema compiler is busy; retry shortly",
        code="schema_compiler_busy",
        headers={"Retry-After": "1"},
    )


def _set(started: asyncio.Future[None]) -> None:
    if not started.done():
        started.set_result(None)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """`fn(*args)` on `loop` from a worker thread (dropped if the loop has closed meanwhile)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def schema_checker(state: Any) -> SchemaChecker:
    """The server's `SchemaChecker` (`AppState.schemas`, made on first use with the model's tokenizer)."""
    if state.schemas is None:
        state.schemas = SchemaChecker(state.tokenizer, state.engine_info().vocab_size)
    return state.schemas
