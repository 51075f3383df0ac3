"""Fully-sharded LoRA on a column-parallel projection (S-LoRA's scheme, `--fully-sharded-loras`).

Under fully-sharded tensor parallel a rank's pool holds, of every A page of a column-parallel slice
(q, k, v, gate, up), only its `q = page_rank / world` rank-rows (`TensorShard.a_page_rows`), and its B
rows of the slice's output as in the default mode. For a packed projection this computes, for every run
of rows on one adapter and every slice s::

    v_r     = x[run] @ A_r.T                  [T, q] per page: this rank's share of the shrink
    v       = all_gather(v_r) over the ranks  [T, page_rank] per page: the whole shrink output
    y[run, slice s] += scale * v @ B_rank.T   this rank's output rows

with one all-gather per packed projection (every run, slice and page flattened into one buffer). Every
rank runs the same plan (rank 0's segments), so the buffers agree in size. Rows beyond an adapter's
rank are zero in both A and B, so odd ranks and per-layer ranks (`rank_pattern`) are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.cpu_plans import Segment
    from engine.lora.pool import AdapterPool


def apply_fully_sharded(
    pool: AdapterPool, segments: Sequence[Segment], layer: int, mods: range, x: torch.Tensor, y: torch.Tensor
) -> None:
    """y[run, slice] += scale * all_gather(x[run] @ A_rank.T) @ B_rank.T for every run of `segments`
    and slice (module index) in `mods` at `layer`, in place (module docstring)."""
    gather = pool.all_gather
    assert gather is not None, "a fully-sharded pool is given the group's all-gather"
    pr = pool.page_rank
    q = pool.a[mods[0]].shape[2]
    world = pr // q
    shrunk: list[torch.Tensor] = []
    jobs: list[tuple[Segment, int, int, int, int, float]] = []  # (run, column offset, width, m, page, scale)
    off = 0
    for m in mods:
        width = pool.b[m].shape[2]
        for seg in segments:
            scale = seg.adapter.layer_scalings[layer][m]
            if not seg.adapter.layer_ranks[layer][m]:
                continue
            xs = x[seg.start : seg.end]
            for page in seg.adapter.pages[m]:
                shrunk.append((xs @ pool.a[m][page, layer].to(x.dtype).T).reshape(-1))
                jobs.append((seg, off, width, m, page, scale))
        off += width
    if not jobs:
        return
    every = gather(torch.cat(shrunk)).view(world, -1)  # rank-major: rank r's shares, in job order
    pos = 0
    for seg, off, width, m, page, scale in jobs:
        n = seg.end - seg.start
        v = every[:, pos : pos + n * q].reshape(world, n, q).transpose(0, 1).reshape(n, pr)
        pos += n * q
        out = y[seg.start : seg.end, off : off + width]
        out.addmm_(v.to(x.dtype), pool.b[m][page, layer].to(x.dtype).T, alpha=scale)
