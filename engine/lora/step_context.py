"""Per-step LoRA state shared by every layer, and the two ways of applying it.

Built once per step from the scheduled requests (ordered so each adapter's tokens are contiguous within
the decode group and within each prefill chunk). `apply` adds, for every token t with an adapter and
every slice s of a packed projection::

    y[t, slice s] += scaling[layer, s, slot(t)] * (x[t] @ A_{slot(t), s, layer}.T) @ B_{slot(t), s, layer}.T

- `TorchLoRAContext` (CPU): rows of short runs (decode tokens, each on its own adapter) are gathered:
  per slice, the A and B page of every (row, page) pair are gathered into `[K, page_rank, in]` /
  `[K, out, page_rank]` and applied with one row-vector `bmm` each (index tensors built once per batch
  composition, shared by all layers; no padding to the largest rank). Long runs (prefill chunks)
  multiply the adapter's pages directly, one GEMM pair per page. Pages are zero beyond the rank, so
  whole pages are exact. Rows without an adapter are never touched.
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
    scale: torch.Tensor  # [L, K, 1, 1]: scaling[layer, m, slot(row)] (0 where the layer is not adapted)
    x_index: torch.Tensor | None  # [K] int64 into the gathered rows; None when pairs == rows in order
    y_index: torch.Tensor | None  # [K] int64 flat-batch row of each pair; None when a slice-add fits


@dataclass(slots=True)
class _GatherPlan:
    """Per-step gathered-path state, built once and read by every layer (see `_gather_plan`)."""

    rows: slice | torch.Tensor  # the gathered rows of the flat batch (a slice when contiguous)
    modules: list[_ModulePlan | None]  # per module; None when no gathered row adapts it
    a_ws: torch.Tensor  # workspaces the pages are gathered into, reused by every slice and layer so
    b_ws: torch.Tensor  # they stay in cache (fresh buffers per slice cost extra memory traffic)


class TorchLoRAContext:
    """The CPU LoRA path (see the module docstring); per-step index tensors are built once here."""

    def __init__(self, pool: AdapterPool, segments: list[Segment]) -> None:
        self.pool = pool
        self.segments = [s for s in segments if s.end - s.start >= GATHER_MAX_ROWS]
        short = [s for s in segments if s.end - s.start < GATHER_MAX_ROWS]
        self.gather = _cached_gather_plan(pool, short) if short else None

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """y[t, slice s] += scaling * (x[t] @ A.T) @ B.T for every row t with an adapter (in place)."""
        first = MODULE_INDEX[slice_names[0]]
        mods = range(first, first + len(slice_names))
        if self.segments:
            self._apply_segments(layer_index, mods, x, y)
        if self.gather is not None:
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
                        v = xs @ pool.a[m][page, layer].T
                        out.addmm_(v, pool.b[m][page, layer].T, alpha=scales[m])
                off += width

    def _apply_gathered(self, layer: int, mods: range, x: torch.Tensor, y: torch.Tensor) -> None:
        """Short runs: per slice, gather the A and B page of every (row, page) pair, two `bmm`s::

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
                v = torch.bmm(xk, a_g.transpose(1, 2)).mul_(mp.scale[layer])  # [K, 1, pr]
                b_g = g.b_ws[: k * width * pr].view(k, width, pr)
                torch.index_select(b.view(-1, width, pr), 0, idx, out=b_g)
                d = torch.bmm(v, b_g.transpose(1, 2)).squeeze(1)  # [K, out]
                if mp.y_index is None:
                    y[g.rows, off : off + width].add_(d)
                else:
                    y[:, off : off + width].index_add_(0, mp.y_index, d)
            off += width


def _cached_gather_plan(pool: AdapterPool, segments: list[Segment]) -> _GatherPlan:
    """The plan for these rows and adapters, reused while the batch composition and the pool are unchanged.

    The pool clears `step_cache` on every upload and eviction, so a cached plan never outlives the pages
    it indexes.
    """
    key = tuple((seg.start, seg.end, seg.adapter.slot) for seg in segments)
    hit = pool.step_cache.get("torch_gather")
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = _gather_plan(pool, segments)
    pool.step_cache["torch_gather"] = (key, plan)
    return plan


def _gather_plan(pool: AdapterPool, segments: list[Segment]) -> _GatherPlan:
    """Index tensors for the rows of `segments`: per module, the (row, page) pairs (see `_ModulePlan`)."""
    rows = [r for seg in segments for r in range(seg.start, seg.end)]
    adapters = [seg.adapter for seg in segments for _ in range(seg.start, seg.end)]
    n, layers, dev = len(rows), pool.cfg.num_layers, pool.device
    contiguous = rows == list(range(rows[0], rows[0] + n))
    row_sel: slice | torch.Tensor = (
        slice(rows[0], rows[0] + n) if contiguous else torch.tensor(rows, dtype=torch.int64, device=dev)
    )
    slots = torch.tensor([ad.slot for ad in adapters], dtype=torch.int64, device=dev)
    scal = pool.scalings.index_select(2, slots).to(pool.dtype)  # [L, n_mod, n]
    layer_ids = torch.arange(layers, dtype=torch.int64, device=dev)[:, None]
    modules: list[_ModulePlan | None] = []
    a_size = b_size = 0
    for m in range(len(pool.a)):
        pairs = [(t, page) for t, ad in enumerate(adapters) for page in ad.pages[m]]
        if not pairs:
            modules.append(None)
            continue
        k = len(pairs)
        tok = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=dev)
        pages = torch.tensor([p for _, p in pairs], dtype=torch.int64, device=dev)
        one_each = [t for t, _ in pairs] == list(range(n))
        modules.append(
            _ModulePlan(
                page_rows=pages[None, :] * layers + layer_ids,
                scale=scal[:, m].index_select(1, tok)[:, :, None, None].contiguous(),
                x_index=None if one_each else tok,
                y_index=None if one_each and contiguous else torch.tensor(rows, device=dev)[tok],
            )
        )
        a_size = max(a_size, k * pool.page_rank * pool.a[m].shape[3])
        b_size = max(b_size, k * pool.page_rank * pool.b[m].shape[2])
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
