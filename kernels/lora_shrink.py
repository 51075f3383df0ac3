"""SGMV LoRA shrink: ``out[s, t, :r] = x[t] · A_{slot(t), s}ᵀ`` over a paged adapter pool (Triton)."""

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

_OP = "lora_shrink"


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, H_in]
    a_table_ptr,  # [num_slices, 3] int64: (pool data_ptr, page stride, row stride)
    page_table_ptr,  # [num_slices, max_slots, max_pages] int32
    ranks_ptr,  # [num_slices, max_slots] int32
    token_idx_ptr,  # [T] int32, tokens sorted by slot
    slot_ids_ptr,  # [S] int32
    counts_ptr,  # [S] int32
    starts_ptr,  # [S] int32
    out_ptr,  # [num_slices, T, max_rank] float32
    h_in,
    max_rank,
    max_pages,
    num_n_blocks,
    m_stride,  # rows between a program's row blocks: the grid covers m_stride rows of each segment
    stride_xt,
    stride_pt_s,
    stride_pt_slot,
    stride_rk_s,
    stride_os,
    stride_ot,
    PAGE_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    seg = tl.program_id(2)
    slot = tl.load(slot_ids_ptr + seg)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rk_s + slot), max_rank)
    pid_k = pid % SPLIT_K
    pid_n = (pid // SPLIT_K) % num_n_blocks
    pid_m = pid // (SPLIT_K * num_n_blocks)
    count = tl.load(counts_ptr + seg)
    if pid_n * BLOCK_N >= rank:
        return  # also covers rank == 0
    # Rank column n of this adapter lives in page page_table[s, slot, n // PAGE_RANK], row n % PAGE_RANK.
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    page_idx = offs_n // PAGE_RANK
    mask_n = (offs_n < rank) & (page_idx < max_pages)
    pt_row = page_table_ptr + s * stride_pt_s + slot * stride_pt_slot
    pages = tl.load(pt_row + page_idx, mask=mask_n, other=0).to(tl.int64)
    a_ptr = tl.load(a_table_ptr + s * 3).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_row = pages * tl.load(a_table_ptr + s * 3 + 1) + (offs_n % PAGE_RANK) * tl.load(a_table_ptr + s * 3 + 2)
    k_chunk = tl.cdiv(tl.cdiv(h_in, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, h_in)
    seg_start = tl.load(starts_ptr + seg)
    for m0 in range(pid_m * BLOCK_M, count, m_stride):  # once, unless the grid covers fewer rows
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        tokens = tl.load(token_idx_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            x = tl.load(
                x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            a = tl.load(
                a_ptr + a_row[None, :] + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None], other=0.0
            )
            acc += tl.dot(x, a, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + s * stride_os + tokens[:, None] * stride_ot + offs_n[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc, mask=out_mask)
        else:
            tl.atomic_add(out_ptrs, acc, mask=out_mask)


def shrink_config(
    max_tokens_per_slot: int, h_in: int, max_rank: int, num_slices: int, num_segments: int
) -> dict:
    """Heuristic block sizes (then the tuning hook's override, problem keys as the arguments).

    Decode-sized segments get split-K so that enough programs stream the A pages in parallel.
    """
    block_m = 16 if max_tokens_per_slot <= 16 else (32 if max_tokens_per_slot <= 64 else 64)
    block_n = max(16, min(next_pow2(max_rank), 64))
    block_k = max(16, min(next_pow2(h_in), 128 if block_m <= 32 else 64))
    programs = num_slices * num_segments * cdiv(max_tokens_per_slot, block_m)
    split_k = 1
    while programs * split_k < 256 and h_in // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    default = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k}
    default.update(num_warps=4, num_stages=2)
    problem = {
        "max_tokens_per_slot": max_tokens_per_slot,
        "h_in": h_in,
        "max_rank": max_rank,
        "num_slices": num_slices,
        "num_segments": num_segments,
    }
    return resolve_config(_OP, problem, default)


def _launch_shrink(
    x: Tensor,
    a_pools: list[Tensor],
    page_table: Tensor,
    ranks: Tensor,
    token_indices_sorted: Tensor,
    slot_ids: Tensor,
    slot_token_counts: Tensor,
    slot_token_starts: Tensor,
    grid_tokens: int,
    out: Tensor,
) -> None:
    out.zero_()
    num_segments = slot_ids.shape[0]
    if grid_tokens == 0 or num_segments == 0:
        return
    num_slices, _, max_rank = out.shape
    h_in = x.shape[1]
    cfg = shrink_config(grid_tokens, h_in, max_rank, num_slices, num_segments)
    num_n = cdiv(max_rank, cfg["BLOCK_N"])
    grid_m = cdiv(grid_tokens, cfg["BLOCK_M"])
    grid = (grid_m * num_n * cfg["SPLIT_K"], num_slices, num_segments)
    _lora_shrink_kernel[grid](
        x,
        pointer_table(a_pools),
        page_table,
        ranks,
        token_indices_sorted,
        slot_ids,
        slot_token_counts,
        slot_token_starts,
        out,
        h_in,
        max_rank,
        page_table.shape[2],
        num_n,
        grid_m * cfg["BLOCK_M"],
        x.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        ranks.stride(0),
        out.stride(0),
        out.stride(1),
        PAGE_RANK=a_pools[0].shape[1],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        SPLIT_K=cfg["SPLIT_K"],
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


_lora_shrink_op = torch.library.custom_op("loraplex::lora_shrink", _launch_shrink, mutates_args=("out",))


@_lora_shrink_op.register_fake
def _(x, a_pools, page_table, ranks, token_indices_sorted, slot_ids, counts, starts, max_tokens, out) -> None:
    return None


def lora_shrink(
    x: Tensor,  # [T, H_in] float32/float16/bfloat16, rows may be strided
    a_pools: Sequence[Tensor],  # per slice [num_pages, page_rank, H_in], x.dtype, last dim contiguous
    page_table: Tensor,  # [num_slices, max_slots, max_pages] int32, last dim contiguous
    ranks: Tensor,  # [num_slices, max_slots] int32; 0 = slice not targeted by that adapter
    meta: LoRABatchMeta,
    out: Tensor,  # [num_slices, T, max_rank] float32, overwritten
) -> None:
    """Triton SGMV shrink; same semantics as :func:`kernels.reference.lora_shrink_ref`::

        out[:] = 0;  out[s, t, :r] = x[t] @ A_{slot(t), s}[:r].T   for slot(t) >= 0, r = ranks[s, slot(t)]

    All slices share the same ``page_rank``; ranks are clamped to ``max_rank`` and to the pages in
    ``page_table``. Accumulates in float32 (split-K partial sums are added atomically).
    """
    dev = x.device
    check_tensor(_OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if not a_pools:
        raise ValueError(f"{_OP}: a_pools must hold one pool per slice, got none")
    for i, pool in enumerate(a_pools):
        check_tensor(_OP, f"a_pools[{i}]", pool, ndim=3, dtypes=(x.dtype,), device=dev)
        check_shape(_OP, f"a_pools[{i}]", pool, (None, a_pools[0].shape[1], x.shape[1]))
    num_slices = len(a_pools)
    check_tensor(_OP, "page_table", page_table, ndim=3, dtypes=(torch.int32,), device=dev)
    check_shape(_OP, "page_table", page_table, (num_slices, None, None))
    check_tensor(_OP, "ranks", ranks, ndim=2, dtypes=(torch.int32,), device=dev)
    check_shape(_OP, "ranks", ranks, (num_slices, page_table.shape[1]))
    check_tensor(_OP, "out", out, ndim=3, dtypes=(torch.float32,), device=dev)
    check_shape(_OP, "out", out, (num_slices, x.shape[0], None))
    check_segment_meta(_OP, meta, x, "x", dev)
    check_runnable(_OP, dev, is_interpreted(_lora_shrink_kernel))
    launch(_lora_shrink_op, _launch_shrink)(
        x,
        list(a_pools),
        page_table,
        ranks,
        meta.token_indices_sorted,
        meta.slot_ids,
        meta.slot_token_counts,
        meta.slot_token_starts,
        meta.grid_tokens,
        out,
    )
