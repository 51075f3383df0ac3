"""The native CPU paged attention (`kernels.paged_attention_cpu`) as the torch backend's path for decode
rows, short query runs (speculative verification, small chunks) and prefill.

Once per step (the first layer's call, keyed by the step's metadata object) it decides whether the kernel
serves this step and prepares it. A work item of the kernel is one sequence's KV head, computed by one
thread, so the kernel takes the decodes, the runs of at most `SHORT_RUN_MAX_ROWS` query rows, and every
longer run whose item (rows x keys) is no more than one thread's fair share of the step's work; a run that
would keep one thread busy while the others wait (one long prompt on many threads) goes to SDPA, which
splits it finer. Block tables and lengths are checked once, with torch's current thread count (which the
thread governor may lower between steps). The kernel is 2-5x faster than gathering the blocks for SDPA on
prefill runs of 64-4096 rows, float32 and bfloat16 (docs/benchmarks.md). Later layers reuse the plan: one
foreign-function call per layer. When the library cannot be built, or the dtypes or head size are not
supported, the step gets no plan and the backend takes its torch path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.short_runs import SHORT_RUN_MAX_ROWS

if TYPE_CHECKING:
    from kernels.paged_attention_cpu import PreparedPagedAttention

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NativeStep:
    call: PreparedPagedAttention  # the kernel for the sequences it serves (decodes, short runs)
    rest: list[int]  # sequences it leaves to the torch path (long prefill chunks)


class NativeAttention:
    """Prepares `NativeStep`s; `enabled` False (or a failed build) means no plans, the torch path."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._meta: AttentionMetadata | None = None
        self._step: NativeStep | None = None
        self._broken: str | None = None  # why the library is unusable here, once known
        self.steps_served = 0  # steps that got a plan (tests and stats)

    def step(self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> NativeStep | None:
        """The step's plan, or None when the native kernel does not serve it."""
        if not self.enabled or self._broken is not None or query.device.type != "cpu":
            return None
        if self._meta is meta:
            return self._step
        self._meta, self._step = meta, self._prepare(query, k_cache, meta)
        self.steps_served += self._step is not None
        return self._step

    def _prepare(
        self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> NativeStep | None:
        from kernels.native_build import NativeBuildError
        from kernels.paged_attention_cpu import PreparedPagedAttention, supported

        try:
            if not supported(query.dtype, k_cache.dtype, k_cache.shape[3]) or not k_cache.is_contiguous():
                return None
        except NativeBuildError as exc:
            self._broken = str(exc)
            log.warning("CPU attention uses the torch path: %s", exc)
            return None
        threads = torch.get_num_threads()
        qs, lens = meta.query_start_list, meta.seq_lens_list
        work = [(qs[b + 1] - qs[b]) * lens[b] for b in range(meta.num_seqs)]  # per item: rows x keys
        fair = sum(work) * k_cache.shape[2] / threads  # one thread's share of all the items' work
        seqs: list[int] = []
        rest: list[int] = []
        for b in range(meta.num_seqs):
            short = b < meta.num_decodes or qs[b + 1] - qs[b] <= SHORT_RUN_MAX_ROWS
            (seqs if short or work[b] <= fair else rest).append(b)
        if not seqs:
            return None
        call = PreparedPagedAttention(
            meta.block_tables, meta.seq_lens, meta.query_start_loc, seqs, k_cache, query.dtype,
            query.shape[1], num_threads=threads,
        )  # fmt: skip
        return NativeStep(call, rest)
