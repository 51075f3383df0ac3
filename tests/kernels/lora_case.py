"""Builds LoRA test cases: dense per-adapter A/B, paged into NaN-poisoned pools with random page tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.intmath import cdiv
from kernels.lora_meta import LoRABatchMeta, build_lora_batch_meta

NUM_LAYERS = 2  # pools span layers; tests use the strided view of layer 1


@dataclass
class LoRACase:
    x: Tensor  # [T, H_in]
    meta: LoRABatchMeta
    a_pools: list[Tensor]  # per slice [num_pages, page_rank, H_in] (strided views)
    b_pools: list[Tensor]  # per slice [num_pages, H_out_s, page_rank] (strided views)
    page_table: Tensor  # [num_slices, max_slots, max_pages] int32, unused entries -1
    ranks: Tensor  # [num_slices, max_slots] int32
    scalings: Tensor  # [num_slices, max_slots] float32
    dense_a: dict[tuple[int, int], Tensor]  # (slice, slot) -> [r, H_in] float32
    dense_b: dict[tuple[int, int], Tensor]  # (slice, slot) -> [H_out_s, r] float32
    max_rank: int


def make_case(
    slot_ranks: list[list[int]],  # [num_slices][max_slots] ranks, 0 = not targeted
    token_slots: list[int],  # slot per token, -1 = no adapter
    h_in: int,
    h_outs: list[int],
    page_rank: int,
    dtype: torch.dtype,
    seed: int = 0,
    max_rank: int | None = None,
) -> LoRACase:
    """Random adapters packed into pools; every page or row not holding adapter data is NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_slices, max_slots = len(slot_ranks), len(slot_ranks[0])
    all_ranks = [r for row in slot_ranks for r in row]
    max_rank = max_rank or max(max(all_ranks), 1)
    max_pages = cdiv(max_rank, page_rank)
    page_table = torch.full((num_slices, max_slots, max_pages), -1, dtype=torch.int32)
    a_pools, b_pools, dense_a, dense_b = [], [], {}, {}
    for s in range(num_slices):
        needed = sum(cdiv(r, page_rank) for r in slot_ranks[s])
        num_pages = needed + 3  # spare pages stay NaN
        perm = torch.randperm(num_pages, generator=gen).tolist()
        a_full = torch.full((num_pages, NUM_LAYERS, page_rank, h_in), float("nan"))
        b_full = torch.full((num_pages, NUM_LAYERS, h_outs[s], page_rank), float("nan"))
        for slot, r in enumerate(slot_ranks[s]):
            if r == 0:
                continue
            a = (torch.randn(r, h_in, generator=gen) / h_in**0.5).to(dtype).float()
            b = (torch.randn(h_outs[s], r, generator=gen) / r**0.5).to(dtype).float()
            dense_a[s, slot], dense_b[s, slot] = a, b
            for j in range(cdiv(r, page_rank)):
                page = perm.pop()
                page_table[s, slot, j] = page
                rows = slice(j * page_rank, min((j + 1) * page_rank, r))
                n = rows.stop - rows.start
                a_full[page, 1, :n] = a[rows]
                b_full[page, 1, :, :n] = b[:, rows]
        a_pools.append(a_full.to(dtype)[:, 1])
        b_pools.append(b_full.to(dtype)[:, 1])
    slots = torch.tensor(token_slots, dtype=torch.int32)
    x = torch.randn(len(token_slots), h_in, generator=gen).to(dtype)
    x[slots < 0] = float("nan")  # rows without adapter must never be read
    return LoRACase(
        x=x,
        meta=build_lora_batch_meta(slots),
        a_pools=a_pools,
        b_pools=b_pools,
        page_table=page_table,
        ranks=torch.tensor(slot_ranks, dtype=torch.int32),
        scalings=(torch.rand(num_slices, max_slots, generator=gen) * 2 + 0.25),
        dense_a=dense_a,
        dense_b=dense_b,
        max_rank=max_rank,
    )


def dense_shrink(case: LoRACase) -> Tensor:
    """Independent oracle for shrink from the dense adapters: ``[num_slices, T, max_rank]`` float32."""
    num_slices = case.page_table.shape[0]
    out = torch.zeros(num_slices, case.x.shape[0], case.max_rank)
    for t, slot in enumerate(case.meta.token_slots.tolist()):
        for s in range(num_slices):
            if (s, slot) in case.dense_a:
                a = case.dense_a[s, slot]
                out[s, t, : a.shape[0]] = case.x[t].float() @ a.T
    return out


def dense_expand(case: LoRACase, v: Tensor, y: Tensor) -> Tensor:
    """Independent oracle for expand: ``y + scaled v·Bᵀ`` per slice, in float32."""
    y = y.float().clone()
    off = 0
    for s, pool in enumerate(case.b_pools):
        h = pool.shape[1]
        for t, slot in enumerate(case.meta.token_slots.tolist()):
            if (s, slot) in case.dense_b:
                b = case.dense_b[s, slot]
                y[t, off : off + h] += case.scalings[s, slot] * (v[s, t, : b.shape[1]].float() @ b.T)
        off += h
    return y
