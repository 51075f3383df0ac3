"""The routed experts' small per-expert GEMMs on the CPU (``csrc/moe_gemm_cpu.c``) and their launcher.

`grouped_small_gemm(xs, w, counts, max_rows, ys)` computes ``ys[rows of e] = xs[rows of e] @ w[e].T`` for
the expert-sorted rows `xs` of every expert with 1..max_rows rows (decode's experts), streaming each such
expert's weight once; experts with more rows are left to the caller. Float32 or bfloat16, weights and
activations of one dtype. The library holds the kernel at several instruction-set levels (x86-64:
generic, AVX2, AVX-512 BF16 with vdpbf16ps for bfloat16); the best one this CPU runs is used unless
`isa=` names another. Threads: torch's intra-op count at the call.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from kernels.native_build import AVX2_FLAGS, AVX512_FLAGS, build_isa_levels, isa_entry

_SHORT = {torch.float32: "float", torch.bfloat16: "bf16"}
_I64, _VP, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGS = [_VP, _I64, _VP, _I64, _I64, _I64, _VP, _I64, _VP, _I64, _I64, _INT]
_X86_ISAS = (("generic", ()), ("avx2", AVX2_FLAGS), ("avx512bf16", (*AVX512_FLAGS, "-mavx512bf16")))
_OP = "grouped_small_gemm"


@functools.cache
def _library() -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """The compiled library and the ISA names this CPU runs, lowest first. Raises NativeBuildError."""
    return build_isa_levels("moe_gemm_cpu.c", "MOE_ISA", _X86_ISAS, "moe_gemm_isa_supported", ("-Wno-psabi",))


def available_isas() -> tuple[str, ...]:
    """The instruction-set levels this CPU runs, lowest first (e.g. generic, avx2, avx512bf16)."""
    return _library()[1]


@functools.cache
def _entry(dtype: torch.dtype, isa: str | None):
    return isa_entry(_library(), _OP, f"moe_gemm_{_SHORT[dtype]}", isa, _ARGS)


def supported_dtypes() -> frozenset[torch.dtype]:
    """Dtypes the kernel takes (builds the library on first use; raises NativeBuildError)."""
    _library()
    return frozenset(_SHORT)


def grouped_small_gemm(
    xs: Tensor,  # [N, K] rows sorted by expert, last dim contiguous
    w: Tensor,  # [E, O, K] xs.dtype, each expert's [O, K] contiguous
    counts: Tensor,  # [E] int64 on the CPU: each expert's rows, in order (sum <= N)
    max_rows: int,  # experts with more rows are skipped
    ys: Tensor,  # [N, O] xs.dtype, last dim contiguous: written for the rows of experts not skipped
    isa: str | None = None,
) -> None:
    """`ys[rows of e] = xs[rows of e] @ w[e].T` for every expert e with 1..max_rows rows (module
    docstring); raises ValueError for tensors the kernel does not take."""
    if xs.dtype not in _SHORT or w.dtype != xs.dtype or ys.dtype != xs.dtype:
        raise ValueError(f"{_OP}: xs, w and ys must share one dtype of float32/bfloat16, got "
                         f"{xs.dtype}, {w.dtype}, {ys.dtype}")  # fmt: skip
    if any(t.device.type != "cpu" for t in (xs, w, counts, ys)):
        raise ValueError(f"{_OP}: tensors must be on the CPU")
    num_experts, out_f, in_f = w.shape
    if xs.dim() != 2 or xs.shape[1] != in_f or ys.dim() != 2 or ys.shape != (xs.shape[0], out_f):
        raise ValueError(f"{_OP}: shapes xs {tuple(xs.shape)}, w {tuple(w.shape)}, ys {tuple(ys.shape)} "
                         "do not fit ys = xs @ w[e].T")  # fmt: skip
    if (xs.shape[0] and xs.stride(1) != 1) or (ys.shape[0] and ys.stride(1) != 1):
        raise ValueError(f"{_OP}: xs and ys must be contiguous in their last dim")
    if w.stride(2) != 1 or w.stride(1) != in_f:
        raise ValueError(f"{_OP}: each expert's weight must be contiguous")
    if counts.dtype != torch.int64 or counts.shape != (num_experts,) or not counts.is_contiguous():
        raise ValueError(f"{_OP}: counts must be a contiguous int64 [{num_experts}] tensor")
    if int(counts.sum()) > xs.shape[0]:
        raise ValueError(f"{_OP}: counts cover {int(counts.sum())} rows, xs has {xs.shape[0]}")
    rc = _entry(xs.dtype, isa)(
        xs.data_ptr(), xs.stride(0), w.data_ptr(), w.stride(0), out_f, in_f, counts.data_ptr(),
        num_experts, ys.data_ptr(), ys.stride(0), max_rows, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"{_OP}: out of memory")
