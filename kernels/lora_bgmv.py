"""Fused BGMV LoRA for decode-sized segments: ``y[t, slice s] += scale · (x[t] · Aᵀ) · Bᵀ`` in one launch.

At decode each adapter has a few rows, so the SGMV kernels' 16-row tensor-core tiles (`lora_shrink.py`,
`lora_expand.py`) are mostly padding, and the ``[T, r]`` intermediate makes a round trip through memory
between two launches. Here one program owns (a segment's rows, one slice, one range of output columns):
it computes ``v = x_rows · A[r0:r0+BLOCK_R]ᵀ`` over the whole ``H_in`` on chip (CUDA-core FMAs, float32),
then streams its columns of ``B`` and adds ``scale · v · Bᵀ`` into ``y``; ranks above ``BLOCK_R`` loop
over rank chunks (split over the rank, ``y`` read-modified-written once per chunk by the same program).
The packed slices (q|k|v, gate|up) are one launch (grid axis 1). Programs of slot −1 or rank-0 slices
return at once. Which kernel a step uses is `engine.lora.backend.lora_kernel_for`.
"""

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
    is_interpreted,
    launch,
    pointer_table,
)
from kernels.intmath import cdiv, next_pow2
from kernels.lora_meta import LoRABatchMeta
from kernels.tuning import resolve_config

_OP = "lora_bgmv"
# Programs a launch aims for (enough to stream the pages over every SM of a large GPU); the output
# columns of a slice are split into up to that many ranges, each recomputing the shrink from L2.
_TARGET_PROGRAMS = 512
_PRODUCT = 8192  # elements of a program's broadcast product per loop iteration (registers: 64 a thread)


@triton.jit
def _lora_bgmv_kernel(
    x_ptr,  # [T, H_in]
    a_table_ptr,  # [num_slices, 3] int64: (A pool data_ptr, page stride, row stride)
    b_table_ptr,  # [num_slices, 5] int64: (B pool data_ptr, page stride, out-row stride, H_out_s, y offset)
    page_table_ptr,  # [num_slices, max_slots, max_pages] int32
    ranks_ptr,  # [num_slices, max_slots] int32
    scalings_ptr,  # [num_slices, max_slots] float32
    token_idx_ptr,  # [T] int32, tokens sorted by slot
    slot_ids_ptr,  # [S] int32
    counts_ptr,  # [S] int32
    starts_ptr,  # [S] int32
    y_ptr,  # [T, sum_s H_out_s]
    h_in,
    max_rank,
    max_pages,
    n_split,  # programs per (row block, slice, segment), each on n_per_split output columns
    n_per_split,  # output columns per program (a multiple of BLOCK_N)
    m_stride,  # rows between a program's row blocks: the grid covers m_stride rows of each segment
    stride_xt,
    stride_pt_s,
    stride_pt_slot,
    stride_rk_s,
    stride_sc_s,
    stride_yt,
    PAGE_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    seg = tl.program_id(2)
    slot = tl.load(slot_ids_ptr + seg)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rk_s + slot), max_rank)
    if rank <= 0:
        return
    pid_n = pid % n_split
    pid_m = pid // n_split
    h_out = tl.load(b_table_ptr + s * 5 + 3)
    n_lo = pid_n * n_per_split
    if n_lo >= h_out:
        return
    n_hi = tl.minimum(n_lo + n_per_split, h_out)
    count = tl.load(counts_ptr + seg)
    seg_start = tl.load(starts_ptr + seg)
    pt_row = page_table_ptr + s * stride_pt_s + slot * stride_pt_slot
    a_ptr = tl.load(a_table_ptr + s * 3).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_page_stride = tl.load(a_table_ptr + s * 3 + 1)
    a_row_stride = tl.load(a_table_ptr + s * 3 + 2)
    b_ptr = tl.load(b_table_ptr + s * 5).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_page_stride = tl.load(b_table_ptr + s * 5 + 1)
    b_row_stride = tl.load(b_table_ptr + s * 5 + 2)
    y_off = tl.load(b_table_ptr + s * 5 + 4)
    scale = tl.load(scalings_ptr + s * stride_sc_s + slot)
    for m0 in range(pid_m * BLOCK_M, count, m_stride):  # once, unless the grid covers fewer rows
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        tokens = tl.load(token_idx_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
        for r0 in range(0, rank, BLOCK_R):
            # Rank row r of this adapter lives in page page_table[s, slot, r // PAGE_RANK], row r % PAGE_RANK.
            offs_r = r0 + tl.arange(0, BLOCK_R)
            page_idx = offs_r // PAGE_RANK
            mask_r = (offs_r < rank) & (page_idx < max_pages)
            pages = tl.load(pt_row + page_idx, mask=mask_r, other=0).to(tl.int64)
            a_rows = pages * a_page_stride + (offs_r % PAGE_RANK) * a_row_stride
            b_cols = pages * b_page_stride + offs_r % PAGE_RANK
            v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # the T x r intermediate, on chip
            for k0 in range(0, h_in, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < h_in
                x = tl.load(
                    x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0,
                ).to(tl.float32)
                a = tl.load(
                    a_ptr + a_rows[:, None] + offs_k[None, :],
                    mask=mask_r[:, None] & mask_k[None, :],
                    other=0.0,
                ).to(tl.float32)
                v += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
            v = v * scale
            for n0 in range(n_lo, n_hi, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < n_hi
                b = tl.load(
                    b_ptr + b_cols[:, None] + offs_n[None, :] * b_row_stride,
                    mask=mask_r[:, None] & mask_n[None, :],
                    other=0.0,
                ).to(tl.float32)
                delta = tl.sum(v[:, :, None] * b[None, :, :], axis=1)
                y_ptrs = y_ptr + tokens[:, None] * stride_yt + (y_off + offs_n)[None, :]
                y_mask = mask_m[:, None] & mask_n[None, :]
                y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def bgmv_config(
    max_tokens_per_slot: int, h_in: int, max_h_out: int, max_rank: int, num_slices: int, num_segments: int
) -> dict:
    """Heuristic block sizes (then the tuning hook's override, problem keys as the arguments).

    ``BLOCK_M`` covers a decode segment's rows (2 to 8; longer segments loop), ``BLOCK_R`` the rank (at
    most 32; higher ranks loop over chunks); the K and N tiles are as wide as an ``M x R x tile`` product
    of `_PRODUCT` elements allows (up to 256), so that the ``H_in`` loop takes few, wide loads (each
    iteration waits for its loads). ``N_SPLIT`` splits each slice's columns so that about
    `_TARGET_PROGRAMS` programs run.
    """
    block_m = max(2, min(next_pow2(max_tokens_per_slot), 8))
    block_r = max(8, min(next_pow2(max_rank), 32))
    block_k = max(16, min(next_pow2(h_in), _PRODUCT // (block_m * block_r), 256))
    block_n = max(16, min(next_pow2(max_h_out), _PRODUCT // (block_m * block_r), 256))
    programs = num_slices * num_segments * cdiv(max_tokens_per_slot, block_m)
    n_split = max(1, min(cdiv(_TARGET_PROGRAMS, max(programs, 1)), cdiv(max_h_out, block_n)))
    default = {
        "BLOCK_M": block_m,
        "BLOCK_R": block_r,
        "BLOCK_K": block_k,
        "BLOCK_N": block_n,
        "N_SPLIT": n_split,
        "num_warps": 4,
        "num_stages": 2,
    }
    problem = {
        "max_tokens_per_slot": max_tokens_per_slot,
        "h_in": h_in,
        "max_h_out": max_h_out,
        "max_rank": max_rank,
        "num_slices": num_slices,
        "num_segments": num_segments,
    }
    return resolve_config(_OP, problem, default)


def _launch_bgmv(
    x: Tensor,
    a_pools: list[Tensor],
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
    num_slices = len(a_pools)
    h_in = x.shape[1]
    page_rank = a_pools[0].shape[1]
    max_rank = page_table.shape[2] * page_rank
    h_outs = [p.shape[1] for p in b_pools]
    offsets = [sum(h_outs[:i]) for i in range(num_slices)]
    b_table = pointer_table(b_pools, [(h, off) for h, off in zip(h_outs, offsets, strict=True)])
    cfg = bgmv_config(grid_tokens, h_in, max(h_outs), max_rank, num_slices, num_segments)
    n_split = cfg["N_SPLIT"]
    n_per_split = cdiv(cdiv(max(h_outs), n_split), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    grid_m = cdiv(grid_tokens, cfg["BLOCK_M"])
    _lora_bgmv_kernel[(grid_m * n_split, num_slices, num_segments)](
        x,
        pointer_table(a_pools),
        b_table,
        page_table,
        ranks,
        scalings,
        token_indices_sorted,
        slot_ids,
        slot_token_counts,
        slot_token_starts,
        y,
        h_in,
        max_rank,
        page_table.shape[2],
        n_split,
        n_per_split,
        grid_m * cfg["BLOCK_M"],
        x.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        ranks.stride(0),
        scalings.stride(0),
        y.stride(0),
        PAGE_RANK=page_rank,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_R=cfg["BLOCK_R"],
        BLOCK_K=cfg["BLOCK_K"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


_lora_bgmv_op = torch.library.custom_op("loraplex::lora_bgmv", _launch_bgmv, mutates_args=("y",))


@_lora_bgmv_op.register_fake
def _(x, a_pools, b_pools, page_table, ranks, scalings, token_idx, slot_ids, counts, starts, grid, y) -> None:
    return None


def lora_bgmv(
    x: Tensor,  # [T, H_in] float32/float16/bfloat16, rows may be strided
    a_pools: Sequence[Tensor],  # per slice [num_pages, page_rank, H_in], x.dtype, last dim contiguous
    b_pools: Sequence[Tensor],  # per slice [num_pages, H_out_s, page_rank], x.dtype, last dim contiguous
    page_table: Tensor,  # [num_slices, max_slots, max_pages] int32, last dim contiguous
    ranks: Tensor,  # [num_slices, max_slots] int32; 0 = slice not targeted by that adapter
    scalings: Tensor,  # [num_slices, max_slots] float32
    meta: LoRABatchMeta,
    y: Tensor,  # [T, sum_s H_out_s] x.dtype, updated in place
) -> None:
    """Fused shrink + expand; same semantics as :func:`kernels.reference.lora_shrink_expand_ref`::

        y[t, off_s : off_s + H_out_s] += scalings[s, slot] * (x[t] @ A_{slot, s}[:r].T) @ B_{slot, s}[:, :r].T
        for slot = slot(t) >= 0, r = ranks[s, slot] > 0;   off_s = sum of H_out of earlier slices

    ranks are clamped to the pages in ``page_table`` (``max_rank = max_pages * page_rank``). Products and
    sums in float32 (the intermediate never leaves the chip); each ``y`` element rounded once per rank
    chunk of ``BLOCK_R``. Tokens without adapter and rank-0 slices leave ``y`` untouched.
    """
    dev = y.device
    check_tensor(_OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(_OP, "y", y, ndim=2, dtypes=(x.dtype,), device=x.device)
    if not a_pools or len(a_pools) != len(b_pools):
        raise ValueError(
            f"{_OP}: a_pools and b_pools must hold one pool per slice each, got {len(a_pools)} and "
            f"{len(b_pools)}"
        )
    page_rank = a_pools[0].shape[1] if a_pools[0].dim() == 3 else -1
    for i, (a, b) in enumerate(zip(a_pools, b_pools, strict=True)):
        check_tensor(_OP, f"a_pools[{i}]", a, ndim=3, dtypes=(x.dtype,), device=dev)
        check_shape(_OP, f"a_pools[{i}]", a, (None, page_rank, x.shape[1]))
        check_tensor(_OP, f"b_pools[{i}]", b, ndim=3, dtypes=(x.dtype,), device=dev)
        check_shape(_OP, f"b_pools[{i}]", b, (None, None, page_rank))
    num_slices = len(a_pools)
    check_shape(_OP, "y", y, (x.shape[0], sum(p.shape[1] for p in b_pools)))
    check_tensor(_OP, "page_table", page_table, ndim=3, dtypes=(torch.int32,), device=dev)
    check_shape(_OP, "page_table", page_table, (num_slices, None, None))
    for name, t, dtype in (("ranks", ranks, torch.int32), ("scalings", scalings, torch.float32)):
        check_tensor(_OP, name, t, ndim=2, dtypes=(dtype,), device=dev)
        check_shape(_OP, name, t, (num_slices, page_table.shape[1]))
    check_segment_meta(_OP, meta, x, "x", dev)
    check_runnable(_OP, dev, is_interpreted(_lora_bgmv_kernel))
    launch(_lora_bgmv_op, _launch_bgmv)(
        x,
        list(a_pools),
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
