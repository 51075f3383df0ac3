"""Per-step LoRA state shared by every layer, and the two ways of applying it.

Built once per step from the scheduled requests (ordered so each adapter's tokens are contiguous within
the decode group and within each prefill chunk). `apply` adds, for every token t with an adapter and
every slice s of a packed projection::

    y[t, slice s] += scaling[layer, s, slot(t)] * (x[t] @ A_{slot(t), s, layer}.T) @ B_{slot(t), s, layer}.T

- `TorchLoRAContext` (CPU): rows of short runs (decode tokens, each on its own adapter) are applied per
  (row, page) pair. With the native backend, the compiled BGMV kernel reads each pair's pages in place
  (`kernels/lora_bgmv_cpu.py`); with the torch backend, per slice, the A and B page of every pair are
  gathered into `[K, page_rank, in]` / `[K, out, page_rank]` and applied with one row-vector `bmm` each.
  Index tensors are built once per batch composition and shared by all layers; no padding to the
  largest rank. Long runs (prefill chunks) multiply the adapter's pages directly, one GEMM pair per
  page. Pages are zero beyond the rank, so whole pages are exact. Rows without an adapter are never
  touched. Pages narrower than the activations (`lora_dtype`) are widened as they are used.
- `TritonLoRAContext` (CUDA): the SGMV shrink/expand kernels over the page tables, one launch each
  per packed projection.
Both match `kernels.reference.lora_shrink_ref` / `lora_expand_ref`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.lora.pool import MODULE_INDEX, AdapterPool, ResidentAdapter


@dataclass(slots=True)
class Segment:
    start: int
    end: int
    adapter: ResidentAdapter


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


# Runs shorter than this many rows (decode tokens) take the gathered path; longer runs (prefill chunks,
# many decodes on one adapter) multiply the shared pages directly.
GATHER_MAX_ROWS = 4


@dataclass(slots=True)
class _ModulePlan:
    """Gathered-path indices for one module: one entry per (row, page) pair of the gathered rows.

    Pairs are ordered by row, then page; a row whose adapter does not target the module has none.
    """

    page_rows: torch.Tensor  # [L, K] int64: row `page * L + layer` of `pool.a[m].view(-1, pr, in)`
    page_ranks: torch.Tensor  # [L, K] int32: rank rows of the pair's page at that layer (0: not adapted)
    scale: torch.Tensor  # [L, K] float32: scaling[layer, m, slot(row)] (0 where the layer is not adapted)
    rows: torch.Tensor  # [K] int64: flat-batch row of each pair
    x_index: torch.Tensor | None  # [K] int64 into the gathered rows; None when pairs == rows in order
    y_index: torch.Tensor | None  # [K] int64 flat-batch row of each pair; None when a slice-add fits


@dataclass(slots=True)
class _GatherPlan:
    """Per-step gathered-path state, built once and read by every layer (see `_gather_plan`)."""

    rows: slice | torch.Tensor  # the gathered rows of the flat batch (a slice when contiguous)
    modules: list[_ModulePlan | None]  # per module; None when no gathered row adapts it
    a_ws: torch.Tensor  # workspaces the torch path gathers pages into, reused by every slice and layer
    b_ws: torch.Tensor  # so they stay in cache (fresh buffers per slice cost extra memory traffic)


class TorchLoRAContext:
    """The CPU LoRA path (see the module docstring); per-step index tensors are built once here.

    With `native`, short runs go through the compiled BGMV kernel (`kernels.lora_bgmv_cpu`), which
    reads each pair's pages in place instead of gathering them; it needs float32 activations.
    """

    def __init__(self, pool: AdapterPool, segments: list[Segment], native: bool = False) -> None:
        self.pool = pool
        self.segments = [s for s in segments if s.end - s.start >= GATHER_MAX_ROWS]
        short = [s for s in segments if s.end - s.start < GATHER_MAX_ROWS]
        self.gather = _cached_gather_plan(pool, short, native) if short else None
        self.native = native
        self.num_threads = torch.get_num_threads()

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """y[t, slice s] += scaling * (x[t] @ A.T) @ B.T for every row t with an adapter (in place)."""
        first = MODULE_INDEX[slice_names[0]]
        mods = range(first, first + len(slice_names))
        if self.segments:
            self._apply_segments(layer_index, mods, x, y)
        if self.gather is not None:
            if self.native:
                self._apply_native(layer_index, mods, x, y)
            else:
                self._apply_gathered(layer_index, mods, x, y)

    def _apply_segments(self, layer: int, mods: range, x: torch.Tensor, y: torch.Tensor) -> None:
        """Long runs: per run and slice, one (x @ A_page.T) @ B_page.T GEMM pair per page."""
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
        """Short runs through the native kernel: one call per slice, pages read where they lie."""
        from kernels.lora_bgmv_cpu import lora_bgmv_cpu

        g, pool, pr = self.gather, self.pool, self.pool.page_rank
        if x.stride(-1) != 1:
            x = x.contiguous()
        off = 0
        for m in mods:
            a, b, mp = pool.a[m], pool.b[m], g.modules[m]
            width = b.shape[2]
            if mp is not None:
                lora_bgmv_cpu(
                    x, y[:, off : off + width], a.view(-1, pr, a.shape[3]), b.view(-1, width, pr),
                    mp.page_rows[layer], mp.page_ranks[layer], mp.rows, mp.scale[layer],
                    num_threads=self.num_threads, checked=False,
                )  # fmt: skip
            off += width

    def _apply_gathered(self, layer: int, mods: range, x: torch.Tensor, y: torch.Tensor) -> None:
        """Short runs in torch: per slice, gather the A and B page of every (row, page) pair, two `bmm`s::

        v[k]  = x[row(k)] @ A_g[k].T * scale[k]     A_g [K, page_rank, in]
        y[row(k), slice] += v[k] @ B_g[k].T          B_g [K, out, page_rank]  (summed over a row's pages)
        """
        g, pool = self.gather, self.pool
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
                xk = xg if mp.x_index is None else xg.index_select(0, mp.x_index)
                v = torch.bmm(xk, a_g.to(x.dtype).transpose(1, 2)).mul_(mp.scale[layer].view(k, 1, 1))
                b_g = g.b_ws[: k * width * pr].view(k, width, pr)
                torch.index_select(b.view(-1, width, pr), 0, idx, out=b_g)
                d = torch.bmm(v, b_g.to(x.dtype).transpose(1, 2)).squeeze(1)  # [K, out]
                if mp.y_index is None:
                    y[g.rows, off : off + width].add_(d)
                else:
                    y[:, off : off + width].index_add_(0, mp.y_index, d)
            off += width


def _cached_gather_plan(pool: AdapterPool, segments: list[Segment], native: bool) -> _GatherPlan:
    """The plan for these rows and adapters, reused while the batch composition and the pool are unchanged.

    The pool clears `step_cache` on every upload and eviction, so a cached plan never outlives the pages
    it indexes.
    """
    key = (native, *((seg.start, seg.end, seg.adapter.slot) for seg in segments))
    hit = pool.step_cache.get("torch_gather")
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = _gather_plan(pool, segments, workspaces=not native)
    pool.step_cache["torch_gather"] = (key, plan)
    return plan


def _gather_plan(pool: AdapterPool, segments: list[Segment], workspaces: bool = True) -> _GatherPlan:
    """Index tensors for the rows of `segments`: per module, the (row, page) pairs (see `_ModulePlan`)."""
    rows = [r for seg in segments for r in range(seg.start, seg.end)]
    adapters = [seg.adapter for seg in segments for _ in range(seg.start, seg.end)]
    n, layers, dev, pr = len(rows), pool.cfg.num_layers, pool.device, pool.page_rank
    contiguous = rows == list(range(rows[0], rows[0] + n))
    row_sel: slice | torch.Tensor = (
        slice(rows[0], rows[0] + n) if contiguous else torch.tensor(rows, dtype=torch.int64, device=dev)
    )
    slots = torch.tensor([ad.slot for ad in adapters], dtype=torch.int64, device=dev)
    scal = pool.scalings.index_select(2, slots)  # [L, n_mod, n] float32
    layer_ids = torch.arange(layers, dtype=torch.int64, device=dev)[:, None]
    modules: list[_ModulePlan | None] = []
    a_size = b_size = 0
    for m in range(len(pool.a)):
        pairs = [(t, j, page) for t, ad in enumerate(adapters) for j, page in enumerate(ad.pages[m])]
        if not pairs:
            modules.append(None)
            continue
        k = len(pairs)
        tok = torch.tensor([t for t, _, _ in pairs], dtype=torch.int64, device=dev)
        pages = torch.tensor([p for _, _, p in pairs], dtype=torch.int64, device=dev)
        page_ranks = [
            [min(pr, max(0, adapters[t].layer_ranks[layer][m] - j * pr)) for t, j, _ in pairs]
            for layer in range(layers)
        ]
        pair_rows = torch.tensor(rows, dtype=torch.int64, device=dev)[tok]
        one_each = [t for t, _, _ in pairs] == list(range(n))
        modules.append(
            _ModulePlan(
                page_rows=pages[None, :] * layers + layer_ids,
                page_ranks=torch.tensor(page_ranks, dtype=torch.int32, device=dev),
                scale=scal[:, m].index_select(1, tok).contiguous(),
                rows=pair_rows,
                x_index=None if one_each else tok,
                y_index=None if one_each and contiguous else pair_rows,
            )
        )
        a_size = max(a_size, k * pr * pool.a[m].shape[3])
        b_size = max(b_size, k * pr * pool.b[m].shape[2])
    if not workspaces:
        a_size = b_size = 0
    a_ws = torch.empty(a_size, dtype=pool.dtype, device=dev)
    b_ws = torch.empty(b_size, dtype=pool.dtype, device=dev)
    return _GatherPlan(row_sel, modules, a_ws, b_ws)


class TritonLoRAContext:
    def __init__(self, pool: AdapterPool, token_slots: torch.Tensor) -> None:
        from kernels.lora_meta import build_lora_batch_meta

        self.pool = pool
        self.meta = build_lora_batch_meta(token_slots)
        self.max_rank = pool.max_pages_per_adapter * pool.page_rank

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        from kernels.lora_expand import lora_expand
        from kernels.lora_shrink import lora_shrink

        pool = self.pool
        first = MODULE_INDEX[slice_names[0]]
        mods = range(first, first + len(slice_names))
        page_table = pool.page_table[first : first + len(slice_names)]
        ranks = pool.ranks[layer_index, first : first + len(slice_names)]
        v = torch.empty(len(slice_names), x.shape[0], self.max_rank, dtype=torch.float32, device=x.device)
        lora_shrink(x, [pool.a[m][:, layer_index] for m in mods], page_table, ranks, self.meta, v)
        scalings = pool.scalings[layer_index, first : first + len(slice_names)]
        lora_expand(v, [pool.b[m][:, layer_index] for m in mods], page_table, ranks, scalings, self.meta, y)
