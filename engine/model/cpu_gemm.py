"""Prepacked oneDNN weights for the CPU's float32 projections and LM head.

`F.linear` on a dense weight lets the GEMM library re-block the weight inside every call. torch.compile
with freezing (what vLLM's compiled CPU path runs) instead reorders each weight once into oneDNN's blocked
layout and calls oneDNN's matmul on it. We do the same at load time: `pack` reorders a weight once and
`packed_linear` multiplies by it, `y = x @ W.T (+ b)` as `F.linear` computes, to float32 rounding (the
sum is blocked differently). On a 2-core AMD EPYC (AVX2) this is 1.15-1.7x faster per call at decode
shapes (docs/benchmarks.md).

The packed weight replaces the dense one, so it costs no memory, except for an LM head tied to the
embedding table: the table stays dense for the lookups and the head gets a packed copy. Float32 only:
torch packs bfloat16 weights only on CPUs with AVX-512 BF16-class conversions, and the bfloat16 GEMMs are
a different path. `can_pack` checks, once per process, that this torch build has the ops and that they
compute what `F.linear` does.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# Rows the packed layout is chosen for: a decode step's batch (the layout works for any row count).
DECODE_ROWS_HINT = 32


@functools.cache
def _ops_work() -> bool:
    """The oneDNN packing ops exist in this torch build and agree with `F.linear` on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        y = packed_linear(x, pack(w), b)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4))


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on `device` in `dtype` are packed: float32 on the CPU, where the ops work."""
    return device.type == "cpu" and dtype == torch.float32 and _ops_work()


def pack(weight: Tensor) -> Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout (an opaque tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_ROWS_HINT)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """`x @ W.T (+ bias)` for the packed W; x [T, in] (rows may be strided) -> [T, out], dense."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
