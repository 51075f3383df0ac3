"""Prepacked oneDNN weights for the CPU's float32 and bfloat16 projections and LM head.

`F.linear` on a dense weight lets the GEMM library re-block the weight inside every call. torch.compile
with freezing (what vLLM's compiled CPU path runs) instead reorders each weight once into oneDNN's blocked
layout and calls oneDNN's matmul on it. We do the same at load time: `pack` reorders a weight once and
`packed_linear` multiplies by it, `y = x @ W.T (+ b)` as `F.linear` computes, to float32 rounding (the
sum is blocked differently). On a 2-core AMD EPYC (AVX2) this is 1.15-1.7x faster per call at decode
shapes (docs/benchmarks.md).

The packed weight replaces the dense one, so it costs no memory, except for an LM head tied to the
embedding table: the table stays dense for the lookups and the head gets a packed copy. Float32 always;
bfloat16 where oneDNN computes it natively (`torch.ops.mkldnn._is_mkldnn_bf16_supported`: AVX-512 BF16 /
AMX class CPUs, the only ones on which `dtype="auto"` picks bfloat16). There the packed form gives the
same bits as `F.linear` (which calls the same oneDNN kernels) and is 1.2-1.3x faster per call on a 2-core
Zen 4 EPYC. `can_pack` checks, once per process and dtype, that this torch build has the ops and that
they compute what `F.linear` does.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# Rows the packed layout is chosen for: a decode step's batch (the layout works for any row count).
DECODE_ROWS_HINT = 32


@functools.cache
def _ops_work(dtype: torch.dtype) -> bool:
    """The oneDNN packing ops exist in this torch build for `dtype` and agree with `F.linear` on a small
    case (within a few ulp of `dtype`: the sums are blocked differently)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(24, 40, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        y = packed_linear(x, pack(w), b)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 0.1
    return bool(
        y.dtype == dtype and torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=tol, atol=tol)
    )


PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on `device` in `dtype` are packed: float32 on the CPU, and bfloat16 where the CPU
    computes it natively, where the ops work."""
    return device.type == "cpu" and dtype in PACKABLE_DTYPES and _ops_work(dtype)


def pack(weight: Tensor) -> Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout (an opaque tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_ROWS_HINT)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """`x @ W.T (+ bias)` for the packed W; x [T, in] (rows may be strided) -> [T, out], dense."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
