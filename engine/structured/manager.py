"""Structured output inside the engine: one grammar matcher per constrained sequence.

Lifecycle of a constrained sequence (`seq.structured` holds its llguidance matcher):
1. `add_request` -> `check` compiles the spec (cached), so a bad one is refused before anything is
   queued; `attach` gives each of the request's `n` sequences its own matcher. A server's step loop
   first calls `compile_later`, which compiles an uncached spec in a worker thread, and queues the
   request once that is done, so a hard grammar never stalls the step loop (`api.engine_core`).
2. Each step, `begin_step(plan)` starts computing the allowed-token bitmasks of the constrained
   sequences that sample this step, in a worker thread while the model runs (llguidance releases the
   GIL); `masks(reqs)` (called by `MaskingSampler` before sampling) waits for them. EOS is allowed only
   where the grammar may end.
3. After the scheduler appended the sampled tokens, `advance` feeds each token to its matcher; when the
   grammar cannot continue the sequence finishes with "stop". A token the grammar refuses (impossible
   unless the matcher failed) ends that request with an error.
Preemption keeps a sequence's generated tokens and so its matcher: recompute only rebuilds KV.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredSpec, StructuredSpecError

Masks = tuple[list[int], np.ndarray]


class StructuredOutput:
    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.compiler = (
            GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids) if hf_tokenizer is not None else None
        )
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[dict[str, np.ndarray]] | None = None
        self._compile_pool: ThreadPoolExecutor | None = None

    # ---- requests -----------------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """Compile `params.structured` now (cached); `StructuredSpecError` (a ValueError) if it cannot be."""
        if params.structured is None:
            return
        if self.compiler is None:
            raise StructuredSpecError("structured output needs the model's tokenizer, and it has none")
        self.compiler.matcher(params.structured)

    def compile_later(self, params: SamplingParams) -> Future[None] | None:
        """Start compiling `params.structured` in a worker thread; None when there is nothing to compile
        (no spec, no tokenizer, or already cached). The future's exception is the spec's error."""
        spec = params.structured
        if spec is None or self.compiler is None or self.compiler.is_compiled(spec):
            return None
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar-compile")
        return self._compile_pool.submit(_warm, self.compiler, spec)

    def attach(self, seq: Sequence) -> None:
        """Give `seq` its own matcher at the start of its output (the spec was `check`ed)."""
        if seq.params.structured is not None and self.compiler is not None:
            seq.structured = self.compiler.matcher(seq.params.structured)

    # ---- masks --------------------------------------------------------------------------------------
    def begin_step(self, plan: SchedulerOutput) -> None:
        """Start computing the bitmasks of the constrained sequences that sample in `plan`."""
        seqs = [it.seq for it in plan.scheduled if it.sample and it.seq.structured is not None]
        self._pending = None
        if not seqs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar")
        self._pending = self._pool.submit(self._compute, seqs)

    def masks(self, reqs: list[Sequence]) -> Masks | None:
        """(rows of `reqs` that are constrained, their bitmasks), or None when no row is constrained."""
        rows = [i for i, r in enumerate(reqs) if r.structured is not None]
        if not rows:
            return None
        ready = self._pending.result() if self._pending is not None else {}
        missing = [reqs[i] for i in rows if reqs[i].seq_id not in ready]
        if missing:
            ready = ready | self._compute(missing)
        return rows, np.stack([ready[reqs[i].seq_id] for i in rows])

    def _compute(self, seqs: list[Sequence]) -> dict[str, np.ndarray]:
        assert self.compiler is not None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = np.zeros((len(seqs), self.compiler.mask_width // 32), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(s.structured, i) for i, s in enumerate(seqs)], bitmask)
        return {s.seq_id: bitmask[i] for i, s in enumerate(seqs)}

    # ---- after sampling -----------------------------------------------------------------------------
    def advance(
        self, seqs: list[Sequence], finish: Callable[[Sequence, SequenceStatus], None]
    ) -> list[tuple[Sequence, str]]:
        """Feed each constrained sequence its newest token; finish those whose grammar is complete.
        Returns (sequence, error) for the ones whose matcher refused the token."""
        pending, self._pending = self._pending, None
        if pending is not None:  # the step failed before sampling: let the worker finish with the matchers
            pending.exception()
        failed = []
        for seq in seqs:
            matcher = seq.structured
            if matcher is None:
                continue
            if not matcher.consume_token(seq.output_token_ids[-1]):
                failed.append((seq, f"structured output: {matcher.get_error() or 'token refused'}"))
                continue
            if matcher.is_stopped() and not seq.is_finished:
                finish(seq, SequenceStatus.FINISHED_STOPPED)
        return failed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
            self._compile_pool = None


def _warm(compiler: GrammarCompiler, spec: StructuredSpec) -> None:
    """Compile `spec` into `compiler`'s cache (a worker thread's job)."""
    compiler.matcher(spec)
