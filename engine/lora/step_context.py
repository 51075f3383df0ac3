"""Per-step LoRA state shared by every layer, and the two ways of applying it.

Built once per step from the scheduled requests (ordered so each adapter's tokens are contiguous within
the decode group and within each prefill chunk). `apply` adds, for every token t with an adapter and
every slice s of a packed projection::

    y[t, slice s] += scaling[layer, s, slot(t)] * (x[t] @ A_{slot(t), s, layer}.T) @ B_{slot(t), s, layer}.T

- `CpuLoRAContext` (CPU), plans built once per batch composition and shared by all layers
  (`cpu_plans.py`); no padding to the largest rank. With the native backend, one call of the compiled
  BGMV kernel per slice applies every run (decode tokens and prefill chunks), reading each (run, page)
  pair's pages in place (`kernels/lora_bgmv_cpu.py`). With the torch backend, rows of short runs
  (decode tokens) are applied per (row, page) pair: per slice, the A and B page of every pair are
  gathered into `[K, page_rank, in]` / `[K, out, page_rank]` and applied with one row-vector `bmm`
  each; long runs (prefill chunks) multiply the adapter's pages directly, one GEMM pair per page.
  Pages are zero beyond the rank, so whole pages are exact. Rows without an adapter are never
  touched. Pages narrower than the activations (`lora_dtype`) are widened as they are used.
- `TritonLoRAContext` (CUDA): per packed projection, the fused BGMV kernel (decode-sized runs) or the
  SGMV shrink and expand kernels over the page tables, by `engine.lora.backend.lora_kernel_for`.
Both match `kernels.reference.lora_shrink_ref` / `lora_expand_ref`.

After the LoRA pass, rows of a DoRA or lora_bias adapter get that adapter's per-row epilogue
`y[rows, slice] ← y ⊙ f + c` (`engine/lora/dora.py`, vectors kept in the pool); base rows and plain-LoRA
rows are not touched.

Both contexts also carry the step's embedding / LM-head LoRA (`vocab`, `engine/lora/vocab_step.py`),
which the model applies to its lookups and logits, and its LoRA on a MoE model's experts (`experts`,
`engine/lora/expert_step.py`), which the MoE block applies per (expert, adapter) run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.lora.backend import apply_triton_lora, lora_kernel_for, max_rows_per_adapter
from engine.lora.cpu_plans import GatherPlan, NativePlan, Segment, cached_plan, gather_plan, native_plan
from engine.lora.epilogue import RowEpilogue
from engine.lora.expert_step import expert_step
from engine.lora.pool import MODULE_INDEX, AdapterPool, ResidentAdapter
from engine.lora.sharded_shrink import apply_fully_sharded
from engine.lora.vocab_step import VocabLoRAStep, adapter_runs
from kernels.lora_meta import LoRABatchMeta, build_lora_batch_meta

__all__ = ["CpuLoRAContext", "Segment", "TritonLoRAContext", "token_segments"]


def token_segments(token_counts: Sequence[int], adapters: Sequence[ResidentAdapter | None]) -> list[Segment]:
    """Merge consecutive requests with the same adapter into runs of flat-batch rows (base runs dropped)."""
    segs: list[Segment] = []
    row = 0
    for n, ad in zip(token_counts, adapters, strict=True):
        if ad is not None:
            if segs and segs[-1].adapter is ad and segs[-1].end == row:
                segs[-1].end += n
            else:
                segs.append(Segment(row, row + n, ad))
        row += n
    return segs


# Torch backend: runs shorter than this many rows (decode tokens) are applied row by row (gathered);
# longer runs (prefill chunks, many decodes on one adapter) multiply the shared pages as GEMMs.
GATHER_MAX_ROWS = 4


class CpuLoRAContext:
    """The CPU LoRA path (see the module docstring); per-step index tensors are built once here.

    With `native`, every run goes through the compiled BGMV kernel (`kernels.lora_bgmv_cpu`), which
    reads each pair's pages in place instead of gathering them (float32, bfloat16 or float16 activations).
    """

    def __init__(
        self, pool: AdapterPool, segments: list[Segment], native: bool = False, tag: str = ""
    ) -> None:
        """`tag` names this context's plans in the pool's step cache (one per pass of a weighted mix,
        `engine/lora/mix.py`, so the passes do not evict each other's plans)."""
        self.pool = pool
        self.tag = tag
        self.runs = segments  # every run, for fully-sharded slices (`sharded_shrink.py`)
        self.native: NativePlan | None = None
        self.gather: GatherPlan | None = None
        self.segments: list[Segment] = []  # long runs for `_apply_segments`
        self._native_segments: list[Segment] | None = None
        self.epilogue = RowEpilogue(
            pool.epilogues, [(s.adapter, range(s.start, s.end)) for s in segments if s.adapter.epi_slot >= 0]
        )
        self.vocab = VocabLoRAStep([(s.adapter, range(s.start, s.end)) for s in segments])
        self.experts = expert_step(pool, [(s.adapter, range(s.start, s.end)) for s in segments])
        if native:  # the plan is made by the first `apply`, which knows the activations' dtype
            self._native_segments = segments
            return
        self.segments = [s for s in segments if s.end - s.start >= GATHER_MAX_ROWS]
        short = [s for s in segments if s.end - s.start < GATHER_MAX_ROWS]
        if short:
            self.gather = cached_plan(pool, "cpu_gather" + tag, short, gather_plan)

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """y[t, slice s] += scaling * (x[t] @ A.T) @ B.T for every row t with an adapter (in place)."""
        first = MODULE_INDEX[slice_names[0]]
        mods = range(first, first + len(slice_names))
        shard = self.pool.shard
        if shard is not None and shard.splits_a(slice_names[0]):
            apply_fully_sharded(self.pool, self.runs, layer_index, mods, x, y)
        elif self._native_segments is not None:
            self._apply_native(layer_index, mods, x, y)
        else:
            if self.segments:
                self._apply_segments(layer_index, mods, x, y)
            if self.gather is not None:
                self._apply_gathered(layer_index, mods, x, y)
        if self.epilogue:
            self.epilogue.apply(layer_index, mods, y)

    def _apply_segments(self, layer: int, mods: range, x: torch.Tensor, y: torch.Tensor) -> None:
        """Long runs: per run and slice, one (x @ A_page.T) @ B_page.T GEMM pair per page.

        (Batching the runs into padded `bmm`s was measured slower: these GEMMs are compute-bound.)"""
        pool = self.pool
        for seg in self.segments:
            xs = x[seg.start : seg.end]
            ranks = seg.adapter.layer_ranks[layer]
            scales = seg.adapter.layer_scalings[layer]
            off = 0
            for m in mods:
                width = pool.b[m].shape[2]
                if ranks[m]:
                    out = y[seg.start : seg.end, off : off + width]
                    for page in seg.adapter.pages[m]:
                        v = xs @ pool.a[m][page, layer].to(x.dtype).T
                        out.addmm_(v, pool.b[m][page, layer].to(x.dtype).T, alpha=scales[m])
                off += width

    def _apply_native(self, layer: int, mods: range, x: torch.Tensor, y: torch.Tensor) -> None:
        """All runs through the native kernel: one prepared call per slice, pages read where they lie."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        assert y.stride(-1) == 1 and y.dtype == x.dtype, "native LoRA: x and y of one dtype, unit stride"
        if self.native is None:
            assert self._native_segments is not None, "a native context keeps its segments for the plan"
            # threads and the activations' dtype are part of the cache key: a plan's calls fix both
            key = (torch.get_num_threads(), x.dtype)
            self.native = cached_plan(
                self.pool, "cpu_native" + self.tag, self._native_segments, native_plan, *key
            )
        off = 0
        for m in mods:
            call = self.native.calls[m]
            if call is not None:
                call(layer, x, y, off)
            off += self.pool.b[m].shape[2]

    def _apply_gathered(self, layer: int, mods: range, x: torch.Tensor, y: torch.Tensor) -> None:
        """Short runs in torch: per slice, gather the A and B page of every (row, page) pair, two `bmm`s::

        v[k]  = x[row(k)] @ A_g[k].T * scale[k]     A_g [K, page_rank, in]
        y[row(k), slice] += v[k] @ B_g[k].T          B_g [K, out, page_rank]  (summed over a row's pages)
        """
        g, pool = self.gather, self.pool
        assert g is not None, "gather plan is built when the context runs in torch"
        pr = pool.page_rank
        xg = x[g.rows] if isinstance(g.rows, slice) else x.index_select(0, g.rows)
        xg = xg.unsqueeze(1)  # [n, 1, in]: row-vector bmm (M=1) is the fast CPU form
        off = 0
        for m in mods:
            a, b, mp = pool.a[m], pool.b[m], g.modules[m]
            width = b.shape[2]
            if mp is not None:
                idx = mp.page_rows[layer]
                k, fin = idx.shape[0], a.shape[3]
                a_g = g.a_ws[: k * pr * fin].view(k, pr, fin)
                torch.index_select(a.view(-1, pr, fin), 0, idx, out=a_g)
                xk = xg if mp.entry_index is None else xg.index_select(0, mp.entry_index)
                v = torch.bmm(xk, a_g.to(x.dtype).transpose(1, 2)).mul_(mp.scale[layer].view(k, 1, 1))
                b_g = g.b_ws[: k * width * pr].view(k, width, pr)
                torch.index_select(b.view(-1, width, pr), 0, idx, out=b_g)
                d = torch.bmm(v, b_g.to(x.dtype).transpose(1, 2)).squeeze(1)  # [K, out]
                pair_rows = g.pair_rows[m]
                if g.slice_add[m]:
                    y[g.rows, off : off + width].add_(d)
                else:
                    assert pair_rows is not None, "a targeted module has pair rows"
                    y[:, off : off + width].index_add_(0, pair_rows, d)
            off += width


class TritonLoRAContext:
    """The CUDA path: per packed projection, one fused BGMV launch (every adapter has at most
    `BGMV_MAX_ROWS` rows in the step) or one SGMV shrink and one expand launch, over the page tables.

    `slots[t]` is the pool slot of flat-batch row t's adapter (-1: none). The SGMV metadata (rows grouped
    by slot) is built on the device at the first `apply`, unless given (`meta`: the static buffers of a
    CUDA-graph decode step, `engine/decode_graphs.py`), so a step replayed from a graph builds none.
    """

    def __init__(
        self,
        pool: AdapterPool,
        slots: list[int],
        meta: LoRABatchMeta | None = None,
        kernel: str | None = None,
    ) -> None:
        self.pool = pool
        self.slots = slots
        self._meta = meta
        # "bgmv" or "sgmv", by the step's longest run on one adapter (`engine.lora.backend.lora_kernel_for`)
        self.kernel = kernel or lora_kernel_for(max_rows_per_adapter(slots))
        by_slot = {r.slot: r for r in pool.resident.values() if r.epi_slot >= 0}
        runs: list[tuple[ResidentAdapter, range]] = []  # DoRA / lora_bias rows (graph steps have none)
        for t, slot in enumerate(slots):
            if slot in by_slot:
                if runs and runs[-1][0] is by_slot[slot] and runs[-1][1].stop == t:
                    runs[-1] = (by_slot[slot], range(runs[-1][1].start, t + 1))
                else:
                    runs.append((by_slot[slot], range(t, t + 1)))
        self.epilogue = RowEpilogue(pool.epilogues, runs)
        vocab = {r.slot: r for r in pool.resident.values() if r.vocab is not None}
        self.vocab = VocabLoRAStep(adapter_runs(slots, vocab) if vocab else [])
        experts = {r.slot: r for r in pool.resident.values() if r.experts is not None}
        self.experts = expert_step(pool, adapter_runs(slots, experts) if experts else [])

    @property
    def meta(self) -> LoRABatchMeta:
        if self._meta is None:
            device = self.pool.page_table.device
            self._meta = build_lora_batch_meta(torch.tensor(self.slots, dtype=torch.int32, device=device))
        return self._meta

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        first = MODULE_INDEX[slice_names[0]]
        mods = range(first, first + len(slice_names))
        apply_triton_lora(self.pool, self.meta, self.kernel, layer_index, mods, x, y)
        if self.epilogue:
            self.epilogue.apply(layer_index, mods, y)
