"""Tile helpers shared by the fused MoE GEMM (`kernels/fused_moe.py`) and its LoRA shrink
(`kernels/moe_lora.py`): both walk row blocks of (token, expert) pairs sorted by group and read the
input rows those pairs stand for."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_pairs(sorted_ids_ptr, pid_m, num_pairs, a_row_div, BLOCK_M: tl.constexpr):
    """Row block `pid_m`'s pair ids, which of them are real (not padding), and the input row each real
    pair reads (pair // a_row_div; 0 for padding) as int64."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pairs < num_pairs
    rows = tl.where(mask_m, pairs // a_row_div, 0).to(tl.int64)
    return pairs, mask_m, rows


@triton.jit
def load_rows(a_ptr, rows, mask_m, stride_am, offs_k, mask_k):
    """The [BLOCK_M, BLOCK_K] tile of input rows `rows` at columns `offs_k` (zeros where masked)."""
    return tl.load(
        a_ptr + rows[:, None] * stride_am + offs_k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
