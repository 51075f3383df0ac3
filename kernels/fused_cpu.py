"""Fused elementwise ops of the CPU decoder step: the native kernels (``csrc/fused_cpu.c``) and launchers.

- `add_rms_norm`: the residual add (in place) and the RMSNorm of its result, in one pass;
- `rope_`: RoPE on the q and k heads of a packed qkv row, in place, reading the float32 cos/sin tables
  at each token's position (optionally after Qwen3's per-head RMSNorm of q and k); with partial rotary
  (tables narrower than half a head) only each head's leading `2 * table width` values turn;
- `silu_mul`: SwiGLU's ``silu(gate) * up`` from the packed gate|up projection output.

Each matches the unfused torch formula of `engine/model/decoder.py` and `engine/model/rope.py` (float32
math, rounded to the element type where torch rounds; see the C source). Tensors are float32, bfloat16
or float16 on the CPU. The library holds the kernels at several instruction-set levels (x86-64:
generic, AVX2, AVX-512), bit-identical to each other; the best one this CPU runs is used unless `isa=`
names another. Threads: torch's intra-op count at the call (``torch.get_num_threads()``), for calls
large enough to split (as torch's elementwise ops).

The functions check their inputs on every call; the engine's decoder uses `FusedStep`, checked once per
forward pass, whose calls are one foreign-function call each.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kernels.native_build import AVX2_FLAGS, AVX512_FLAGS, build_isa_levels

_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_I64, _VP, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_ARGTYPES = {
    "fused_add_rms_norm": ([_VP, _I64, _VP, _I64, _VP, _I64, _VP, _I64, _I64, _F32, _INT], None),
    "fused_rope": (
        [_VP, _I64, _I64, _I64, _I64, _I64, _VP, _I64, _VP, _VP, _I64, _VP, _VP, _F32, _INT],
        ctypes.c_int,
    ),
    "fused_silu_mul": ([_VP, _I64, _VP, _I64, _I64, _I64, _INT], None),
}

_COMMON = ("-ffp-contract=off", "-Wno-psabi")  # separate multiply and add at every level: same bits
_X86_ISAS = (("generic", ()), ("avx2", AVX2_FLAGS), ("avx512", AVX512_FLAGS))


@functools.cache
def _library() -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """The compiled library and the ISA names this CPU runs, lowest first (built on first use).
    Raises NativeBuildError."""
    return build_isa_levels("fused_cpu.c", "FUSED_ISA", _X86_ISAS, "fused_isa_supported", _COMMON)


def forget_library() -> None:
    """Drop the loaded library and entry points, so the next use builds (or loads) it again (tests)."""
    _library.cache_clear()
    _entries.cache_clear()


def available_isas() -> tuple[str, ...]:
    """The instruction-set levels this CPU runs, lowest first (e.g. generic, avx2, avx512)."""
    return _library()[1]


@functools.cache
def _entries(isa: str | None) -> dict[tuple[str, torch.dtype], Callable[..., Any]]:
    """Entry points by (op, dtype) at `isa` (None: the best). Raises NativeBuildError, ValueError."""
    lib, runs = _library()
    isa = isa or runs[-1]
    if isa not in runs:
        raise ValueError(f"fused_cpu: instruction set {isa!r} is not available here (have {', '.join(runs)})")
    out = {}
    for dtype, short in _SHORT.items():
        if dtype == torch.float16 and not lib.fused_has_f16():
            continue  # the compiler has no _Float16
        for op, (argtypes, restype) in _ARGTYPES.items():
            fn = getattr(lib, f"{op}_{short}_{isa}")
            fn.argtypes, fn.restype = argtypes, restype
            out[(op, dtype)] = fn
    return out


def supported_dtypes() -> frozenset[torch.dtype]:
    """Dtypes the kernels handle here (builds the library on first use; raises NativeBuildError)."""
    return frozenset(d for _, d in _entries(None))


def _check_rows(op: str, name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dim() != 2 or t.dtype != dtype or t.device.type != "cpu" or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{op}: {name} must be a 2-d {dtype} CPU tensor with unit column stride, got "
            f"{tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}"
        )


def add_rms_norm(
    residual: Tensor,  # [T, H], updated in place when delta is given
    delta: Tensor | None,  # [T, H] residual's dtype, or None (no add)
    weight: Tensor,  # [H] residual's dtype, contiguous
    eps: float,
    isa: str | None = None,
) -> Tensor:
    """``residual += delta`` (rounded to its dtype), then return a new [T, H] tensor
    ``weight * (residual * rsqrt(mean(residual^2, -1) + eps)).to(dtype)`` (float32 norm, as HF)."""
    op = "add_rms_norm"
    dtype = residual.dtype
    _check_rows(op, "residual", residual, dtype)
    rows, cols = residual.shape
    if delta is not None:
        _check_rows(op, "delta", delta, dtype)
        if delta.shape != residual.shape:
            raise ValueError(f"{op}: delta {tuple(delta.shape)} and residual {tuple(residual.shape)} differ")
    if weight.shape != (cols,) or weight.dtype != dtype or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous [{cols}] {dtype}, got {tuple(weight.shape)}")
    out = torch.empty(rows, cols, dtype=dtype)
    _entries(isa)[("fused_add_rms_norm", dtype)](
        residual.data_ptr(), residual.stride(0),
        None if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride(0),
        out.data_ptr(), cols, weight.data_ptr(), rows, cols, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_(
    x: Tensor,  # [T, W] rows whose first `heads * head_dim` columns are the heads to rotate (q heads, then k)
    heads: int,
    head_dim: int,
    positions: Tensor,  # [T] int64, contiguous
    cos: Tensor,  # [P, R // 2] float32, contiguous; R (rotary dims, even) <= head_dim
    sin: Tensor,  # [P, R // 2] float32, contiguous
    qk_norm: tuple[Tensor, Tensor, int, float] | None = None,  # (q weight [D], k weight [D], q heads, eps)
    isa: str | None = None,
) -> None:
    """Rotate the first R values of heads ``0..heads-1`` of every row in place: ``x1, x2 = x1*c - x2*s,
    x2*c + x1*s`` at the row's position (HF's ``x*cos + rotate_half(x)*sin``, float32 math; the rest of
    each head as is). With `qk_norm`, each head is first RMS-normalized over its `head_dim` values with
    the q weight (heads below `q heads`) or the k weight."""
    op = "rope"
    dtype = x.dtype
    _check_rows(op, "x", x, dtype)
    rows = x.shape[0]
    if head_dim % 2 or heads * head_dim > x.shape[1]:
        raise ValueError(
            f"{op}: {heads} heads of {head_dim} do not fit rows of {x.shape[1]} (or odd head_dim)"
        )
    if positions.shape != (rows,) or positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError(f"{op}: positions must be contiguous [{rows}] int64, got {tuple(positions.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or not 0 < t.shape[1] <= head_dim // 2 or t.shape != cos.shape:
            raise ValueError(f"{op}: {name} must be [P, R/2] like cos, R <= {head_dim}")
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous float32")
    q_w = k_w = None
    q_heads, eps = 0, 0.0
    if qk_norm is not None:
        q_w, k_w, q_heads, eps = qk_norm
        for name, w in (("q weight", q_w), ("k weight", k_w)):
            if w.shape != (head_dim,) or w.dtype != dtype or not w.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous [{head_dim}] {dtype}")
    rc = _entries(isa)[("fused_rope", dtype)](
        x.data_ptr(), x.stride(0), rows, heads, head_dim, 2 * cos.shape[1], positions.data_ptr(),
        cos.shape[0], cos.data_ptr(), sin.data_ptr(), q_heads, None if q_w is None else q_w.data_ptr(),
        None if k_w is None else k_w.data_ptr(), eps, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"{op}: a position is outside the tables' {cos.shape[0]} positions")


def silu_mul(
    gate_up: Tensor,  # [T, 2I]: gate columns, then up columns
    isa: str | None = None,
) -> Tensor:
    """A new [T, I] tensor ``silu(gate) * up`` (silu rounded to the dtype before the multiply, as torch)."""
    op = "silu_mul"
    dtype = gate_up.dtype
    _check_rows(op, "gate_up", gate_up, dtype)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"{op}: gate_up has an odd width {width}")
    inter = width // 2
    out = torch.empty(rows, inter, dtype=dtype)
    _entries(isa)[("fused_silu_mul", dtype)](
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter, torch.get_num_threads()
    )
    return out


class FusedStep:
    """The three ops for one forward pass, checked once here; then each call is one foreign-function call.

    For the engine's decoder, which calls them a few times per layer on tensors it made itself: every
    tensor passed is a CPU tensor of `dtype` with unit column stride (activations, rows strided or not)
    or contiguous (weights), as the checked functions above require — not checked again per call.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        positions: Tensor,  # [T] int64, contiguous: the tokens' positions (for RoPE)
        cos: Tensor,  # [P, D/2] float32, contiguous
        sin: Tensor,  # [P, D/2] float32, contiguous
    ) -> None:
        entries = _entries(None)
        if ("fused_rope", dtype) not in entries:
            raise ValueError(f"fused_cpu: no kernels for {dtype} here")
        if positions.dim() != 1 or positions.dtype != torch.int64 or not positions.is_contiguous():
            raise ValueError("fused_cpu: positions must be a contiguous 1-d int64 tensor")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2 or t.shape != cos.shape or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"fused_cpu: {name} must be contiguous [P, D/2] float32 like cos")
        self.dtype, self.rows, self.threads = dtype, positions.shape[0], torch.get_num_threads()
        self._norm = entries[("fused_add_rms_norm", dtype)]
        self._rope = entries[("fused_rope", dtype)]
        self._silu = entries[("fused_silu_mul", dtype)]
        self._keep = (positions, cos, sin)  # the pointers below stay valid
        self._tables = (positions.data_ptr(), cos.shape[0], cos.data_ptr(), sin.data_ptr())
        self._half = cos.shape[1]

    def add_rms_norm(self, residual: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
        """As `add_rms_norm` (delta, if given, of residual's shape)."""
        rows, cols = residual.shape
        out = torch.empty(rows, cols, dtype=self.dtype)
        d, ds = (None, 0) if delta is None else (delta.data_ptr(), delta.stride(0))
        self._norm(residual.data_ptr(), residual.stride(0), d, ds, out.data_ptr(), cols, weight.data_ptr(),
                   rows, cols, eps, self.threads)  # fmt: skip
        return out

    def rope_(
        self,
        x: Tensor,
        heads: int,
        qk_norm: tuple[Tensor, Tensor, int, float] | None = None,
        head_dim: int | None = None,
    ) -> None:
        """As `rope_` on this step's rows, positions and tables; `head_dim` defaults to 2 * the tables'
        width (wider: partial rotary, the first 2 * width values of each head turn)."""
        r = 2 * self._half
        d = r if head_dim is None else head_dim
        if x.shape[0] != self.rows or heads * d > x.shape[1] or d < r:
            raise ValueError(
                f"fused_cpu: rope_ on {tuple(x.shape)} for {heads} heads of {d}, {self.rows} rows"
            )
        qw, kw, qh, eps = (None, None, 0, 0.0) if qk_norm is None else qk_norm
        rc = self._rope(x.data_ptr(), x.stride(0), self.rows, heads, d, r, *self._tables, qh,
                        None if qw is None else qw.data_ptr(), None if kw is None else kw.data_ptr(), eps,
                        self.threads)  # fmt: skip
        if rc != 0:
            raise ValueError(f"fused_cpu: a position is outside the tables' {self._tables[1]} positions")

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """As `silu_mul`."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=self.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter, self.threads)
        return out
