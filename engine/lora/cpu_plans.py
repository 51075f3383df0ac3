"""Per-step index tensors for the CPU LoRA paths, built once per batch composition and read by every layer.

Rows of the flat batch that share an adapter form a run (`Segment`). Both plans list, per module,
(entry, page) pairs: one per page the entry's adapter holds on that module, ordered by entry, then page,
so mixed ranks need no padding to the largest rank.

- `NativePlan` (native backend): entries are runs, any length; per module a prepared call of the
  native kernel for every layer (`kernels.lora_bgmv_cpu.PreparedBGMV`).
- `GatherPlan` (torch backend): entries are the rows of short runs (decode tokens), each on its own,
  with workspaces the pages are gathered into.

`cached_plan` keeps the last plan of each kind on the pool's `step_cache`, which the pool clears on
every upload and eviction, so a plan never outlives the pages it indexes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from engine.lora.pool import AdapterPool, ResidentAdapter


@dataclass(slots=True)
class Segment:
    """A run of flat-batch rows [start, end) on one adapter."""

    start: int
    end: int
    adapter: ResidentAdapter


@dataclass(slots=True)
class ModulePairs:
    """The (entry, page) pairs of one module (an entry whose adapter does not target it has none).

    `entry_index[k]` is the entry (row or run) of pair k; None when there is one pair per entry, in order.
    """

    page_rows: torch.Tensor  # [L, K] int64: row `page * L + layer` of `pool.a[m].view(-1, pr, in)`
    page_ranks: torch.Tensor  # [L, K] int32: rank rows of the pair's page at that layer (0: not adapted)
    scale: torch.Tensor  # [L, K] float32: scaling[layer, m, slot] (0 where the layer is not adapted)
    entry_index: torch.Tensor | None  # [K] int64


@dataclass(slots=True)
class GatherPlan:
    """Short runs: every row on its own (see the module docstring)."""

    rows: slice | torch.Tensor  # the gathered rows of the flat batch (a slice when contiguous)
    modules: list[ModulePairs | None]  # per module
    pair_rows: list[torch.Tensor | None]  # per module: [K] int64 flat-batch row of each pair
    slice_add: list[bool]  # per module: pairs are exactly `rows` in order (a slice-add fits)
    a_ws: torch.Tensor  # workspaces the pages are gathered into, reused by every slice and layer so
    b_ws: torch.Tensor  # they stay in cache (fresh buffers per slice cost extra memory traffic)


@dataclass(slots=True)
class NativePlan:
    """All runs, through the native kernel (see the module docstring)."""

    calls: list  # per module: PreparedBGMV over all layers, or None where no run's adapter targets it


def cached_plan(pool: AdapterPool, kind: str, segments: list[Segment], build: Callable, *args):
    """`build(pool, segments, *args)`, reused while the batch composition and the pool are unchanged."""
    key = (args, *((seg.start, seg.end, seg.adapter.slot) for seg in segments))
    hit = cast("tuple[Any, Any] | None", pool.step_cache.get(kind))  # (key, plan) as stored below
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = build(pool, segments, *args)
    pool.step_cache[kind] = (key, plan)
    return plan


def _module_pairs(pool: AdapterPool, adapters: list[ResidentAdapter], m: int) -> ModulePairs | None:
    """The (entry, page) pairs of module m for entries (rows or runs) on `adapters`, one adapter each."""
    layers, dev, pr = pool.cfg.num_layers, pool.device, pool.page_rank
    pairs = [(t, j, page) for t, ad in enumerate(adapters) for j, page in enumerate(ad.pages[m])]
    if not pairs:
        return None
    entry = torch.tensor([t for t, _, _ in pairs], dtype=torch.int64, device=dev)
    page_index = torch.tensor([j for _, j, _ in pairs], dtype=torch.int32, device=dev)
    pages = torch.tensor([p for _, _, p in pairs], dtype=torch.int64, device=dev)
    slots = torch.tensor([ad.slot for ad in adapters], dtype=torch.int64, device=dev).index_select(0, entry)
    ranks = pool.ranks[:, m].index_select(1, slots)  # [L, K] true rank of each pair's adapter per layer
    page_ranks = (ranks - page_index * pr).clamp_(0, pr)  # rank rows in use of each page
    scale = pool.scalings[:, m].index_select(1, slots)  # [L, K]
    one_each = [t for t, _, _ in pairs] == list(range(len(adapters)))
    return ModulePairs(
        page_rows=pages[None, :] * layers + torch.arange(layers, dtype=torch.int64, device=dev)[:, None],
        page_ranks=page_ranks.to(torch.int32).contiguous(),
        scale=scale.contiguous(),
        entry_index=None if one_each else entry,
    )


def gather_plan(pool: AdapterPool, segments: list[Segment]) -> GatherPlan:
    """The `GatherPlan` for the rows of `segments`."""
    rows = [r for seg in segments for r in range(seg.start, seg.end)]
    adapters = [seg.adapter for seg in segments for _ in range(seg.start, seg.end)]
    n, dev, pr = len(rows), pool.device, pool.page_rank
    contiguous = rows == list(range(rows[0], rows[0] + n))
    row_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    modules = [_module_pairs(pool, adapters, m) for m in range(len(pool.a))]
    pair_rows = [
        None if mp is None else (row_t if mp.entry_index is None else row_t[mp.entry_index]) for mp in modules
    ]
    a_size = b_size = 0
    for m, mp in enumerate(modules):
        if mp is not None:
            k = mp.page_rows.shape[1]
            a_size = max(a_size, k * pr * pool.a[m].shape[3])
            b_size = max(b_size, k * pr * pool.b[m].shape[2])
    return GatherPlan(
        rows=slice(rows[0], rows[0] + n) if contiguous else row_t,
        modules=modules,
        pair_rows=pair_rows,
        slice_add=[mp is not None and mp.entry_index is None and contiguous for mp in modules],
        a_ws=torch.empty(a_size, dtype=pool.dtype, device=dev),
        b_ws=torch.empty(b_size, dtype=pool.dtype, device=dev),
    )


def native_plan(
    pool: AdapterPool, segments: list[Segment], threads: int = 1, activations: torch.dtype = torch.float32
) -> NativePlan:
    """The `NativePlan` for `segments`: per module, prepared kernel calls over the pool's pages, each on
    `threads` OpenMP threads, for x and y of dtype `activations`."""
    from kernels.lora_bgmv_cpu import PreparedBGMV

    dev, pr = pool.device, pool.page_rank
    starts = torch.tensor([seg.start for seg in segments], dtype=torch.int64, device=dev)
    counts = torch.tensor([seg.end - seg.start for seg in segments], dtype=torch.int32, device=dev)
    adapters = [seg.adapter for seg in segments]
    calls: list[PreparedBGMV | None] = []
    for m in range(len(pool.a)):
        mp = _module_pairs(pool, adapters, m)
        if mp is None or pool.a[m].shape[2] != pr:  # rank-split A (fully sharded): `sharded_shrink.py`
            calls.append(None)
            continue
        idx = mp.entry_index
        a = pool.a[m].view(-1, pr, pool.a[m].shape[3])
        b = pool.b[m].view(-1, pool.b[m].shape[2], pr)
        runs = (starts, counts) if idx is None else (starts[idx], counts[idx])
        calls.append(
            PreparedBGMV(
                a,
                b,
                mp.page_rows,
                mp.page_ranks,
                *runs,
                mp.scale,
                num_threads=threads,
                activations=activations,
            )
        )
    return NativePlan(calls)
