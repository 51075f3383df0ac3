"""SGMV LoRA expand: ``y[t, slice s] += scale · v[s, t, :r] · B_{slot(t), s}ᵀ`` over a paged pool (Triton)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import (
    FLOAT_DTYPES,
    check_runnable,
    check_segment_meta,
    check_shape,
    check_tensor,
    dot_precision,
    is_interpreted,
    launch,
    pointer_table,
)
from kernels.intmath import cdiv, next_pow2
from kernels.lora_meta import LoRABatchMeta
from kernels.tuning import resolve_config

_OP = "lora_expand"
_INFO = 5  # per-slice row of the pointer table: (data_ptr, page stride, out-row stride, H_out_s, y offset)


@triton.jit
def _lora_expand_kernel(
    v_ptr,  # [num_slices, T, max_rank]
    b_table_ptr,  # [num_slices, 5] int64
    page_table_ptr,  # [num_slices, max_slots, max_pages] int32
    ranks_ptr,  # [num_slices, max_slots] int32
    scalings_ptr,  # [num_slices, max_slots] float32
    token_idx_ptr,  # [T] int32, tokens sorted by slot
    slot_ids_ptr,  # [S] int32
    counts_ptr,  # [S] int32
    starts_ptr,  # [S] int32
    y_ptr,  # [T, sum_s H_out_s]
    max_rank,
    max_pages,
    num_n_blocks,
    m_stride,  # rows between a program's row blocks: the grid covers m_stride rows of each segment
    stride_vs,
    stride_vt,
    stride_pt_s,
    stride_pt_slot,
    stride_rk_s,
    stride_sc_s,
    stride_yt,
    PAGE_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    seg = tl.program_id(2)
    slot = tl.load(slot_ids_ptr + seg)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rk_s + slot), max_rank)
    h_out = tl.load(b_table_ptr + s * 5 + 3)
    pid_n = pid % num_n_blocks
    pid_m = pid // num_n_blocks
    count = tl.load(counts_ptr + seg)
    if rank <= 0 or pid_n * BLOCK_N >= h_out:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < h_out
    b_ptr = tl.load(b_table_ptr + s * 5).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_page_stride = tl.load(b_table_ptr + s * 5 + 1)
    b_cols = offs_n * tl.load(b_table_ptr + s * 5 + 2)
    pt_row = page_table_ptr + s * stride_pt_s + slot * stride_pt_slot
    scale = tl.load(scalings_ptr + s * stride_sc_s + slot)
    y_cols = tl.load(b_table_ptr + s * 5 + 4) + offs_n
    seg_start = tl.load(starts_ptr + seg)
    for m0 in range(pid_m * BLOCK_M, count, m_stride):  # once, unless the grid covers fewer rows
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        tokens = tl.load(token_idx_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
        v_rows = v_ptr + s * stride_vs + tokens * stride_vt
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, rank, BLOCK_K):
            # Rank index k lives in page page_table[s, slot, k // PAGE_RANK], column k % PAGE_RANK.
            offs_k = k0 + tl.arange(0, BLOCK_K)
            page_idx = offs_k // PAGE_RANK
            mask_k = (offs_k < rank) & (page_idx < max_pages)
            pages = tl.load(pt_row + page_idx, mask=mask_k, other=0).to(tl.int64)
            v = tl.load(v_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(
                b_ptr + (pages * b_page_stride + offs_k % PAGE_RANK)[:, None] + b_cols[None, :],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc += tl.dot(v.to(b.dtype), b, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + tokens[:, None] * stride_yt + y_cols[None, :]
        y_mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc * scale).to(y_ptr.dtype.element_ty), mask=y_mask)


def expand_config(
    max_tokens_per_slot: int, max_h_out: int, max_rank: int, num_slices: int, num_segments: int
) -> dict:
    """Heuristic block sizes (then the tuning hook's override, problem keys as the arguments)."""
    block_m = 16 if max_tokens_per_slot <= 16 else (32 if max_tokens_per_slot <= 64 else 64)
    block_n = max(16, min(next_pow2(max_h_out), 128 if block_m <= 32 else 64))
    block_k = max(16, min(next_pow2(max_rank), 64))
    default = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2}
    problem = {
        "max_tokens_per_slot": max_tokens_per_slot,
        "max_h_out": max_h_out,
        "max_rank": max_rank,
        "num_slices": num_slices,
        "num_segments": num_segments,
    }
    return resolve_config(_OP, problem, default)


def _launch_expand(
    v: Tensor,
    b_pools: list[Tensor],
    page_table: Tensor,
    ranks: Tensor,
    scalings: Tensor,
    token_indices_sorted: Tensor,
    slot_ids: Tensor,
    slot_token_counts: Tensor,
    slot_token_starts: Tensor,
    grid_tokens: int,
    y: Tensor,
) -> None:
    num_segments = slot_ids.shape[0]
    if grid_tokens == 0 or num_segments == 0:
        return
    num_slices, _, max_rank = v.shape
    h_outs = [p.shape[1] for p in b_pools]
    offsets = [sum(h_outs[:i]) for i in range(num_slices)]
    table = pointer_table(b_pools, [(h, off) for h, off in zip(h_outs, offsets, strict=True)])
    cfg = expand_config(grid_tokens, max(h_outs), max_rank, num_slices, num_segments)
    num_n = cdiv(max(h_outs), cfg["BLOCK_N"])
    grid_m = cdiv(grid_tokens, cfg["BLOCK_M"])
    grid = (grid_m * num_n, num_slices, num_segments)
    _lora_expand_kernel[grid](
        v,
        table,
        page_table,
        ranks,
        scalings,
        token_indices_sorted,
        slot_ids,
        slot_token_counts,
        slot_token_starts,
        y,
        max_rank,
        page_table.shape[2],
        num_n,
        grid_m * cfg["BLOCK_M"],
        v.stride(0),
        v.stride(1),
        page_table.stride(0),
        page_table.stride(1),
        ranks.stride(0),
        scalings.stride(0),
        y.stride(0),
        PAGE_RANK=b_pools[0].shape[2],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION=dot_precision(y.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


_lora_expand_op = torch.library.custom_op("loraplex::lora_expand", _launch_expand, mutates_args=("y",))


@_lora_expand_op.register_fake
def _(v, b_pools, page_table, ranks, scalings, token_idx, slot_ids, counts, starts, max_tokens, y) -> None:
    return None


def lora_expand(
    v: Tensor,  # [num_slices, T, max_rank] float32 (shrink's out) or y.dtype, last dim contiguous
    b_pools: Sequence[Tensor],  # per slice [num_pages, H_out_s, page_rank], y.dtype, last dim contiguous
    page_table: Tensor,  # [num_slices, max_slots, max_pages] int32, last dim contiguous
    ranks: Tensor,  # [num_slices, max_slots] int32; 0 = slice not targeted by that adapter
    scalings: Tensor,  # [num_slices, max_slots] float32
    meta: LoRABatchMeta,
    y: Tensor,  # [T, sum_s H_out_s] float32/float16/bfloat16, updated in place
) -> None:
    """Triton SGMV expand; same semantics as :func:`kernels.reference.lora_expand_ref`::

        y[t, off_s : off_s + H_out_s] += scalings[s, slot] * v[s, t, :r] @ B_{slot, s}[:, :r].T
        for slot = slot(t) >= 0, r = ranks[s, slot] > 0;   off_s = sum of H_out of earlier slices

    Accumulates in float32; for fp16/bf16 weights ``v`` is rounded to the weight dtype before the
    product (tensor-core path). Tokens without adapter and rank-0 slices leave ``y`` untouched.
    """
    dev = y.device
    check_tensor(_OP, "y", y, ndim=2, dtypes=FLOAT_DTYPES)
    if not b_pools:
        raise ValueError(f"{_OP}: b_pools must hold one pool per slice, got none")
    page_rank = b_pools[0].shape[2] if b_pools[0].dim() == 3 else -1
    for i, pool in enumerate(b_pools):
        check_tensor(_OP, f"b_pools[{i}]", pool, ndim=3, dtypes=(y.dtype,), device=dev)
        check_shape(_OP, f"b_pools[{i}]", pool, (None, None, page_rank))
    num_slices = len(b_pools)
    total = sum(p.shape[1] for p in b_pools)
    check_shape(_OP, "y", y, (None, total))
    check_tensor(_OP, "v", v, ndim=3, dtypes=tuple({torch.float32, y.dtype}), device=dev)
    check_shape(_OP, "v", v, (num_slices, y.shape[0], None))
    check_tensor(_OP, "page_table", page_table, ndim=3, dtypes=(torch.int32,), device=dev)
    check_shape(_OP, "page_table", page_table, (num_slices, None, None))
    for name, t, dtype in (("ranks", ranks, torch.int32), ("scalings", scalings, torch.float32)):
        check_tensor(_OP, name, t, ndim=2, dtypes=(dtype,), device=dev)
        check_shape(_OP, name, t, (num_slices, page_table.shape[1]))
    check_segment_meta(_OP, meta, y, "y", dev)
    check_runnable(_OP, dev, is_interpreted(_lora_expand_kernel))
    launch(_lora_expand_op, _launch_expand)(
        v,
        list(b_pools),
        page_table,
        ranks,
        scalings,
        meta.token_indices_sorted,
        meta.slot_ids,
        meta.slot_token_counts,
        meta.slot_token_starts,
        meta.grid_tokens,
        y,
    )
