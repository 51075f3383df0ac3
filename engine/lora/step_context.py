"""Per-step LoRA state shared by every layer, and the two ways of applying it.

Built once per step from the scheduled requests (ordered so each adapter's tokens are contiguous within
the decode group and within each prefill chunk). `apply` adds, for every token t with an adapter and
every slice s of a packed projection::

    y[t, slice s] += scaling[layer, s, slot(t)] * (x[t] @ A_{slot(t), s, layer}.T) @ B_{slot(t), s, layer}.T

- `TorchLoRAContext` (CPU): for each contiguous run of tokens sharing an adapter, one small GEMM pair
  per page of that adapter (pages are zero beyond the rank, so whole pages are exact). Rows without an
  adapter are never touched.
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


class TorchLoRAContext:
    def __init__(self, pool: AdapterPool, segments: list[Segment]) -> None:
        self.pool = pool
        self.segments = segments

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        pool = self.pool
        first = MODULE_INDEX[slice_names[0]]
        for seg in self.segments:
            xs = x[seg.start : seg.end]
            ranks = seg.adapter.layer_ranks[layer_index]
            scales = seg.adapter.layer_scalings[layer_index]
            off = 0
            for s in range(len(slice_names)):
                m = first + s
                width = pool.b[m].shape[2]
                if ranks[m]:
                    out = y[seg.start : seg.end, off : off + width]
                    for page in seg.adapter.pages[m]:
                        v = xs @ pool.a[m][page, layer_index].T
                        out.addmm_(v, pool.b[m][page, layer_index].T, alpha=scales[m])
                off += width


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
