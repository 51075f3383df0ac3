"""LoRA on the routed experts for the fused-MoE kernel (`kernels/fused_moe.py`): each (token, expert) pair
adds its own request's adapter delta for that expert::

    y[p] += s_a · (a[p] · A_{a,e}ᵀ) · B_{a,e}ᵀ        p = t * k + j, e = topk_ids[t, j], a = token_adapter[t]

(a[p] = x[t] for gate|up, h[p] for down). Pairs are grouped by (expert, adapter): the routing alignment is
built over the group id `g = e * (A + 1) + a` (`group_ids`; a = A: no adapter), so every row block of the
kernels reads one expert's weights and one adapter's pages. Two steps per projection: the shrink below
writes `v[p, j * R : (j + 1) * R] = s_a · a[p] · A[page_j]ᵀ` (float32) for each page j of the adapter, and
the fused-MoE pass adds `v · B[page_j]ᵀ` to its accumulators before its epilogue (SiLU·up, or the routing
weight), so the delta is in the sum the base GEMM rounds once.

Pages are the adapter pool's expert pages of one layer (`engine/lora/expert_pages.py`): A `[pages, E, R,
in]`, B `[pages, E, out, R]`, zero past an adapter's rank. Semantics: `kernels.reference.fused_moe_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import dot_precision, is_interpreted, launch
from kernels.intmath import next_pow2
from kernels.moe_align import MoEAlignment
from kernels.moe_lora_meta import ExpertLoRAWeights
from kernels.moe_tiles import block_pairs, load_rows


@triton.jit
def _moe_lora_shrink_kernel(
    a_ptr,  # [rows, K]: x [T, H] (row = pair // top_k) or h [T*k, I] (row = pair)
    la_ptr,  # [num_pages, E, R, K] A pages
    pages_ptr,  # [num_adapters, max_pages] int32
    scale_ptr,  # [num_adapters] float32
    v_ptr,  # [T*k, max_pages * R] float32 out: v[p, j*R + r]
    sorted_ids_ptr,  # [max_padded] int32: pair ids by group, sentinel num_pairs = padding
    block_groups_ptr,  # [num_blocks] int32: each row block's group, num_groups = unused
    num_padded_ptr,  # [1] int32
    k_dim,
    num_pairs,
    a_row_div,
    num_groups,
    groups,  # adapter groups per expert: num_adapters + 1
    rank,  # R: rank rows per page
    max_pages,
    stride_am,
    stride_lp,
    stride_le,
    stride_lr,
    stride_vm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # tl.dot in float32: pages in another dtype than a, or bf16 interpreted
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    j = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    group = tl.load(block_groups_ptr + pid_m)
    if group >= num_groups:
        return
    expert = group // groups
    adapter = group % groups
    if adapter == groups - 1:
        return  # rows without an adapter
    page = tl.load(pages_ptr + adapter * max_pages + j)
    if page < 0:
        return
    pairs, mask_m, rows = block_pairs(sorted_ids_ptr, pid_m, num_pairs, a_row_div, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    base = la_ptr + page.to(tl.int64) * stride_lp + expert.to(tl.int64) * stride_le
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_dim
        a = load_rows(a_ptr, rows, mask_m, stride_am, offs_k, mask_k)
        w = tl.load(
            base + offs_r[None, :] * stride_lr + offs_k[:, None],
            mask=mask_k[:, None] & mask_r[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scale_ptr + adapter)
    out = v_ptr + pairs[:, None].to(tl.int64) * stride_vm + j * rank + offs_r[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])


def _launch_shrink(
    a: Tensor,
    la: Tensor,
    pages: Tensor,
    scale: Tensor,
    v: Tensor,
    sorted_ids: Tensor,
    block_groups: Tensor,
    num_padded: Tensor,
    a_row_div: int,
    num_groups: int,
    groups: int,
    block_m: int,
    block_k: int,
) -> None:
    rank, max_pages = la.shape[2], pages.shape[1]
    grid = (block_groups.shape[0], max_pages)
    _moe_lora_shrink_kernel[grid](
        a, la, pages, scale, v, sorted_ids, block_groups, num_padded,
        a.shape[1], v.shape[0], a_row_div, num_groups, groups, rank, max_pages,
        a.stride(0), la.stride(0), la.stride(1), la.stride(2), v.stride(0),
        BLOCK_M=block_m, BLOCK_R=lora_block_r(rank), BLOCK_K=block_k,
        UPCAST=a.dtype != la.dtype or (a.dtype == torch.bfloat16 and is_interpreted(_moe_lora_shrink_kernel)),
        DOT_PRECISION=dot_precision(a.dtype),
    )  # fmt: skip


_shrink_op = torch.library.custom_op("loraplex::fused_moe_lora_shrink", _launch_shrink, mutates_args=("v",))


@_shrink_op.register_fake
def _(a, la, pages, scale, v, *args) -> None:
    return None


def lora_block_r(rank: int) -> int:
    """The rank tile of the shrink and of the fused pass's expand (`tl.dot` takes 16 at least)."""
    return max(16, next_pow2(rank))


def moe_lora_shrink(
    a: Tensor,  # [rows, K] x (a_row_div = top_k) or h (a_row_div = 1), last dim contiguous
    w: ExpertLoRAWeights,
    alignment: MoEAlignment,  # built over `group_ids` with num_experts = E * groups
    a_row_div: int,
    groups: int,
    block_k: int,
) -> Tensor:
    """`v` [T*k, max_pages * R] float32: `v[p, j*R : (j+1)*R] = s_a · a[row(p)] · A[page_j, e]ᵀ` for every
    pair p of a group with an adapter and every page j of that adapter (other entries are not written)."""
    num_pairs = alignment.num_pairs
    v = torch.empty(num_pairs, w.pages.shape[1] * w.a.shape[2], dtype=torch.float32, device=a.device)
    if num_pairs == 0 or w.pages.shape[1] == 0:
        return v
    meta = (alignment.sorted_pair_ids, alignment.block_experts, alignment.num_padded)
    launch(_shrink_op, _launch_shrink)(
        a,
        w.a,
        w.pages,
        w.scale,
        v,
        *meta,
        a_row_div,
        alignment.num_experts,
        groups,
        alignment.block_m,
        block_k,
    )
    return v
