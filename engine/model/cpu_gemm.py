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
import os

import torch
from torch import Tensor

# Rows the packed layout is chosen for: a decode step's batch (the layout works for any row count).
DECODE_ROWS_HINT = 32
# Primitives kept by ideep's and by oneDNN's per-process caches (their default: 1,024 each, ~0.5 MiB an
# entry for the demo model): room for the row buckets steps usually take (decode batches, common prefill
# sizes) times a model's few weight shapes; rarer ones are evicted least recently used first and rebuilt
# (about a millisecond) when they recur. Also what bounds bfloat16, whose rows are not bucketed.
ONEDNN_CACHE_CAPACITY = 128
ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap ideep's and oneDNN's primitive caches at `capacity` entries each, unless the environment
    already sets them. Both read their variable once, at their first primitive, so this must run before
    the process's first oneDNN call (the engine process calls it before loading the model)."""
    for var in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(var, str(capacity))


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


def row_bucket(rows: int) -> int:
    """The row count a float32 packed GEMM of `rows` rows runs at: `rows` up to 8, the next multiple of 8
    up to 64, then four buckets per octave (the next multiple of 2**(bit_length - 3)): 35 sizes up to 2048
    rows, at most 25% padding above 64 rows."""
    if rows <= 8:
        return rows
    if rows <= 64:
        return -(-rows // 8) * 8
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """`x @ W.T (+ bias)` for the packed W; x [T, in] (rows may be strided) -> [T, out], dense.

    oneDNN builds (and caches, per process, up to 1,024 entries in each of ideep's and oneDNN's caches)
    one primitive per distinct (rows, weight) shape, and a step's row count takes any value up to the
    token budget: a server's memory then grows by a cached primitive for every new count for a long time
    (`bench/soak.py`). In float32 the rows are padded with zeros to `row_bucket(T)` (rows are independent
    in a GEMM, so the first T rows are unchanged), so only a few dozen shapes are ever built. Bfloat16 runs
    at T rows: there the packed form must give `F.linear`'s bits (`ONEDNN_CACHE_CAPACITY` bounds it)."""
    rows = x.shape[0]
    padded = row_bucket(rows) if x.dtype == torch.float32 else rows
    if padded == rows:
        return _linear_pointwise(x, packed, bias)
    xp = x.new_empty((padded, x.shape[1]))
    xp[:rows] = x
    xp[rows:] = 0
    return _linear_pointwise(xp, packed, bias)[:rows]


def _linear_pointwise(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's matmul on the packed weight (one cached primitive per shape of `x`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
