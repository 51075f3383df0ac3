"""Fused mixture-of-experts feed-forward (Triton): the step's (token, choice) pairs sorted by expert once
(`kernels/moe_align.py`), one grouped GEMM per projection over the experts that have pairs, then the
weighted combine::

    h[p]   = silu(x[t] @ Wg[e]ᵀ) * (x[t] @ Wu[e]ᵀ)      pass 1: gate|up GEMM, SiLU-and-mul fused
    y[p]   = w[p] * (h[p] @ Wd[e]ᵀ)                     pass 2: down GEMM, routing weight fused
    out[t] = Σ_j y[t * k + j]                           combine (fixed order, no atomics)

for every pair p = t * k + j routed to expert e = topk_ids[t, j] with weight w[p] = topk_weights[t, j].
With expert LoRA (`kernels/moe_lora.py`) the pairs are grouped by (expert, adapter) instead, and each
adapted pass adds its pairs' `s·(a·Aᵀ)·Bᵀ` (shrunk beforehand) to its accumulators before the epilogue.
Both passes run the one kernel below; a row block reads one expert's weights, so a step reads only the
weights of the experts it routes to (decode's cost follows the active parameters, not the total).
Accumulation is float32 and `y` is kept in float32 for the combine, so the output is rounded once; only
`h` is rounded to x's dtype (the down GEMM's input, as tensor cores take it).
Semantics: `kernels.reference.fused_moe_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import (
    FLOAT_DTYPES,
    check_runnable,
    check_shape,
    check_tensor,
    dot_precision,
    is_interpreted,
    launch,
)
from kernels.intmath import next_pow2
from kernels.moe_align import MoEAlignment, align_pairs
from kernels.moe_lora import lora_block_r, moe_lora_shrink
from kernels.moe_lora_meta import MoELoRA, check_lora, group_ids
from kernels.moe_tiles import block_pairs, load_rows
from kernels.tuning import resolve_config

_OP = "fused_moe"


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows, K]: x [T, H] in pass 1 (row = pair // top_k), h [T*k, I] in pass 2 (row = pair)
    w_ptr,  # [E, N_w, K]: gate_up [E, 2I, H] (gate rows, then up rows) in pass 1, down [E, H, I] in pass 2
    out_ptr,  # [T*k, N]: h [T*k, I] in x's dtype in pass 1, y [T*k, H] float32 in pass 2
    sorted_ids_ptr,  # [max_padded] int32: pair ids by expert, sentinel num_pairs = padding
    block_experts_ptr,  # [num_blocks] int32: each row block's group (its expert without LoRA), unused: >= E*G
    num_padded_ptr,  # [1] int32: rows of sorted_ids in use
    weights_ptr,  # [T*k] float32 routing weights (read only when MUL_WEIGHT)
    n,  # output columns N: I (pass 1) or H (pass 2)
    k_dim,  # reduction length K: H (pass 1) or I (pass 2)
    num_pairs,
    a_row_div,  # pairs per row of a: top_k (pass 1), 1 (pass 2)
    num_groups,  # E * groups: block groups at or past it are unused
    groups,  # adapter groups per expert (1 without LoRA): group = expert * groups + adapter
    num_n_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    lv_ptr,  # [T*k, max_pages * R] float32 LoRA shrink of this pass's input (`kernels/moe_lora.py`)
    lb_ptr,  # [num_pages, E, N_w, R] LoRA B pages of this pass's projection
    lpages_ptr,  # [groups - 1, max_pages] int32 each adapter's page ids, -1 past its rank
    rank,  # R
    max_pages,
    stride_vm,
    stride_lbp,
    stride_lbe,
    stride_lbn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr,  # two accumulators (gate rows n, up rows N + n), out = silu(gate) * up
    MUL_WEIGHT: tl.constexpr,  # out row p times weights[p]
    UPCAST: tl.constexpr,  # tl.dot in float32 (the Triton interpreter's bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,
    HAS_LORA: tl.constexpr,  # add the expert LoRA expand v · B[page]ᵀ of each row block's adapter
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    group = tl.load(block_experts_ptr + pid_m)
    if group >= num_groups:
        return
    expert = group // groups
    adapter = group % groups
    pairs, mask_m, rows = block_pairs(sorted_ids_ptr, pid_m, num_pairs, a_row_div, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_dim
        a = load_rows(a_ptr, rows, mask_m, stride_am, offs_k, mask_k)
        w_mask = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_base + offs_k[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if SILU_MUL:
            u = tl.load(w_base + n * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up += tl.dot(a, u, input_precision=DOT_PRECISION)
    if HAS_LORA:  # noqa: SIM102 (a constexpr branch: without LoRA none of this is compiled)
        if adapter < groups - 1:  # the block's rows are one adapter's: add s · (a · Aᵀ) · Bᵀ page by page
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            b_base = lb_ptr + expert.to(tl.int64) * stride_lbe + offs_n[None, :].to(tl.int64) * stride_lbn
            b_mask = mask_r[:, None] & mask_n[None, :]
            v_base = lv_ptr + pairs[:, None].to(tl.int64) * stride_vm + offs_r[None, :]
            for j in range(0, max_pages):
                page = tl.load(lpages_ptr + adapter * max_pages + j)
                if page >= 0:
                    v = tl.load(v_base + j * rank, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                    b_ptrs = b_base + page.to(tl.int64) * stride_lbp + offs_r[:, None]
                    b = tl.load(b_ptrs, mask=b_mask, other=0.0).to(tl.float32)
                    acc += tl.dot(v, b, input_precision=DOT_PRECISION)
                    if SILU_MUL:
                        bu = tl.load(b_ptrs + n * stride_lbn, mask=b_mask, other=0.0).to(tl.float32)
                        acc_up += tl.dot(v, bu, input_precision=DOT_PRECISION)
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        wt = tl.load(weights_ptr + tl.where(mask_m, pairs, 0), mask=mask_m, other=0.0)
        acc = acc * wt[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fused_moe_config(num_pairs: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Heuristic block sizes (then the tuning hook's override for op "fused_moe", problem keys as the
    arguments). BLOCK_M follows the pairs an active expert gets: decode's few rows use the smallest
    `tl.dot` tile instead of padding each expert's run to 64."""
    per_expert = num_pairs // max(min(num_pairs, num_experts), 1)
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)
    default = {
        "BLOCK_M": block_m,
        "BLOCK_N": max(16, min(next_pow2(max(hidden, inter)), 64)),
        "BLOCK_K": max(16, min(next_pow2(min(hidden, inter)), 64)),
        "num_warps": 4,
        "num_stages": 3,
    }
    problem = {"num_pairs": num_pairs, "num_experts": num_experts, "hidden": hidden, "inter": inter}
    return resolve_config(_OP, problem, default)


def _launch_pass(
    a: Tensor,
    w: Tensor,
    out: Tensor,
    sorted_ids: Tensor,
    block_experts: Tensor,
    num_padded: Tensor,
    weights: Tensor,
    a_row_div: int,
    silu_mul: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    groups: int,
    lora_v: Tensor,  # with has_lora: the shrink of a ([T*k, max_pages * R] float32), else any tensor
    lora_b: Tensor,  # with has_lora: [num_pages, E, N_w, R] B pages, else any tensor
    lora_pages: Tensor,  # with has_lora: [groups - 1, max_pages] int32, else any tensor
    has_lora: bool,
) -> None:
    n, k_dim = out.shape[1], a.shape[1]
    num_n = triton.cdiv(n, block_n)
    grid = (block_experts.shape[0] * num_n,)
    rank = lora_b.shape[-1] if has_lora else 1
    lora_strides = (lora_v.stride(0), *lora_b.stride()[:3]) if has_lora else (0, 0, 0, 0)
    _fused_moe_kernel[grid](
        a, w, out, sorted_ids, block_experts, num_padded, weights,
        n, k_dim, out.shape[0], a_row_div, w.shape[0] * groups, groups, num_n,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        lora_v, lora_b, lora_pages, rank, lora_pages.shape[-1] if has_lora else 0, *lora_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, MUL_WEIGHT=not silu_mul,
        UPCAST=a.dtype == torch.bfloat16 and is_interpreted(_fused_moe_kernel),
        DOT_PRECISION=dot_precision(a.dtype), HAS_LORA=has_lora, BLOCK_R=lora_block_r(rank),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


_fused_moe_pass_op = torch.library.custom_op("loraplex::fused_moe_pass", _launch_pass, mutates_args=("out",))


@_fused_moe_pass_op.register_fake
def _(a, w, out, sorted_ids, block_experts, num_padded, weights, *args) -> None:
    return None


def fused_moe(
    x: Tensor,  # [T, H] float32/float16/bfloat16, rows may be strided
    w_gate_up: Tensor,  # [E, 2I, H] x.dtype: gate rows 0..I-1, up rows I..2I-1; last dim contiguous
    w_down: Tensor,  # [E, H, I] x.dtype, last dim contiguous
    topk_weights: Tensor,  # [T, k] any float dtype: each token's routing weights
    topk_ids: Tensor,  # [T, k] int32/int64 in [0, E) ([0, E] with local_subset): each token's experts
    alignment: MoEAlignment | None = None,  # align_pairs(group_ids(topk_ids, lora), E * groups, BLOCK_M)
    lora: MoELoRA | None = None,  # the step's expert LoRA on this layer (`kernels/moe_lora.py`)
    local_subset: bool = False,  # expert parallel: id E marks another rank's expert, whose pairs add nothing
) -> Tensor:
    """The MoE block's routed output [T, H] in x.dtype (module docstring), with each pair's own adapter's
    LoRA on its expert where `lora` is given; same semantics as :func:`kernels.reference.fused_moe_ref`.
    With `local_subset` the weights are one rank's experts (expert parallel) and pairs with id E (an expert
    of another rank) are sorted into a group past the last, which neither pass runs: this rank's partial
    sum (`alignment` is then built here).
    Launches two passes of one kernel (and a LoRA shrink before each adapted pass) and never synchronizes
    with the device (ids out of range are not checked on CUDA)."""
    dev = x.device
    check_tensor(_OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(_OP, "w_gate_up", w_gate_up, ndim=3, dtypes=(x.dtype,), device=dev)
    num_experts, two_inter, hidden = w_gate_up.shape
    if two_inter % 2:
        raise ValueError(f"{_OP}: w_gate_up has {two_inter} rows per expert, expected 2 * intermediate")
    inter = two_inter // 2
    check_shape(_OP, "w_gate_up", w_gate_up, (None, None, x.shape[1]))
    check_tensor(_OP, "w_down", w_down, ndim=3, dtypes=(x.dtype,), device=dev)
    check_shape(_OP, "w_down", w_down, (num_experts, hidden, inter))
    check_tensor(_OP, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    check_tensor(_OP, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    check_shape(_OP, "topk_weights", topk_weights, tuple(topk_ids.shape))
    check_shape(_OP, "topk_ids", topk_ids, (x.shape[0], None))
    check_runnable(_OP, dev, is_interpreted(_fused_moe_kernel))
    num_tokens, top_k = topk_ids.shape
    checkable = dev.type == "cpu" and topk_ids.numel() > 0 and not torch.compiler.is_compiling()
    top = num_experts + int(local_subset)
    if checkable and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < top:  # interpreted
        raise ValueError(f"{_OP}: topk_ids must lie in [0, {top})")
    if local_subset and alignment is not None:
        raise ValueError(f"{_OP}: local_subset builds its own alignment")
    if (
        checkable
        and lora is not None
        and not 0 <= int(lora.token_adapter.min()) <= int(lora.token_adapter.max()) <= lora.num_adapters
    ):
        raise ValueError(f"{_OP}: lora.token_adapter must lie in [0, {lora.num_adapters}]")
    groups = 1
    if lora is not None:
        sizes = {"gate_up": hidden, "down": inter}, {"gate_up": two_inter, "down": hidden}
        check_lora(lora, num_tokens, num_experts, *sizes, dev)
        groups = lora.groups
    cfg = fused_moe_config(num_tokens * top_k, num_experts, hidden, inter)
    if alignment is None:
        alignment = align_pairs(group_ids(topk_ids, lora), top * groups, cfg["BLOCK_M"])
        # the dropped pairs' groups (>= E * groups) count as unused blocks in both passes and the shrink
        alignment.num_experts = num_experts * groups
    elif alignment.num_pairs != topk_ids.numel() or alignment.num_experts != num_experts * groups:
        raise ValueError(f"{_OP}: alignment was built for other pairs, experts or adapter groups")
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=dev)
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=dev)
    # dropped pairs' rows of y are never written: zeros for the combine
    y = (torch.zeros if local_subset else torch.empty)(
        num_tokens * top_k, hidden, dtype=torch.float32, device=dev
    )
    weights = topk_weights.reshape(-1).to(torch.float32)
    meta = (alignment.sorted_pair_ids, alignment.block_experts, alignment.num_padded, weights)
    blocks = (alignment.block_m, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"])
    run = launch(_fused_moe_pass_op, _launch_pass)
    run(x, w_gate_up, h, *meta, top_k, True, *blocks, *_lora_args(x, lora, "gate_up", alignment, top_k, cfg))
    run(h, w_down, y, *meta, 1, False, *blocks, *_lora_args(h, lora, "down", alignment, 1, cfg))
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _lora_args(
    a: Tensor, lora: MoELoRA | None, proj: str, alignment: MoEAlignment, a_row_div: int, cfg: dict
) -> tuple:
    """The LoRA arguments of `_launch_pass` for projection `proj` over the pass's input `a`: its shrink
    (launched here) and pages, or placeholders without LoRA on it."""
    w = getattr(lora, proj) if lora is not None else None
    if lora is None or w is None:
        return 1 if lora is None else lora.groups, a, a, alignment.num_padded, False
    v = moe_lora_shrink(a, w, alignment, a_row_div, lora.groups, cfg["BLOCK_K"])
    return lora.groups, v, w.b, w.pages, True
