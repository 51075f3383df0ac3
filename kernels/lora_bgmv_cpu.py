"""CPU LoRA: the native BGMV kernel (``csrc/lora_bgmv.c``) and its launcher.

One call applies one projection slice at one layer for a list of (run, page) pairs — a run is rows of the
flat batch on one adapter (a decode token, a prefill chunk) — reading the adapter pages in place (see the
C source for the exact formula). Activations and pages are each float32, bfloat16 or float16. Semantics
match ``kernels.reference``: ``lora_shrink_ref``, the scaling, then ``lora_expand_ref``.

The library holds the kernel at several instruction-set levels (x86-64: generic, AVX2, AVX-512 BF16);
the best one this CPU runs is picked when it is loaded (`best_isa`), a lower one on request (`isa=`).
"""

from __future__ import annotations

import ctypes
import functools
from _ctypes import CFuncPtr

import torch
from torch import Tensor

from kernels._common import check_tensor
from kernels.native_build import AVX2_FLAGS, AVX512_FLAGS, build_isa_levels

_OP = "lora_bgmv_cpu"
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_I64, _VP = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_VP, _I64, _VP, _I64, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, ctypes.c_int]

# Instruction-set levels the library is built for on x86-64, lowest first: (name, extra compiler flags).
# Each is the whole kernel compiled for that level; the best one the CPU runs is used.
_X86_ISAS = (("generic", ()), ("avx2", AVX2_FLAGS), ("avx512bf16", (*AVX512_FLAGS, "-mavx512bf16")))


@functools.cache
def _library() -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """The compiled library and the ISA names it has that this CPU runs, lowest first (built on first use).
    Raises NativeBuildError."""
    return build_isa_levels("lora_bgmv.c", "LORA_ISA", _X86_ISAS, "lora_bgmv_isa_supported")


def forget_library() -> None:
    """Drop the loaded library and entry points, so the next use builds (or loads) it again (tests)."""
    _library.cache_clear()
    _kernels_at.cache_clear()


def available_isas() -> tuple[str, ...]:
    """The kernel's instruction-set levels this CPU runs, lowest first (e.g. generic, avx2, avx512bf16)."""
    return _library()[1]


def best_isa() -> str:
    """The level the engine uses: the highest in `available_isas()`."""
    return available_isas()[-1]


_default_isa: str | None = None  # `use_isa`: the level calls without isa= get (None: the best)


def use_isa(isa: str | None) -> None:
    """Make `isa` the level for calls and plans that name none (benchmarks compare levels); None: the best.
    Plans prepared before keep theirs."""
    global _default_isa
    if isa is not None and isa not in available_isas():
        raise ValueError(f"{_OP}: instruction set {isa!r} is not available here")
    _default_isa = isa


def _kernels(isa: str | None = None) -> dict[tuple[torch.dtype, torch.dtype], CFuncPtr]:
    return _kernels_at(isa or _default_isa)


@functools.cache
def _kernels_at(isa: str | None) -> dict[tuple[torch.dtype, torch.dtype], CFuncPtr]:
    """Entry points by (activation dtype, page dtype) at `isa` (default: the best).

    Raises NativeBuildError."""
    lib, runs = _library()
    isa = isa or runs[-1]
    if isa not in runs:
        raise ValueError(f"{_OP}: instruction set {isa!r} is not available here (have {', '.join(runs)})")
    out = {}
    for x_dtype, x_name in _SHORT.items():
        for w_dtype, w_name in _SHORT.items():
            if torch.float16 in (x_dtype, w_dtype) and not lib.lora_bgmv_has_f16():
                continue  # the compiler has no _Float16
            fn = getattr(lib, f"lora_bgmv_{x_name}_{w_name}_{isa}")
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            out[(x_dtype, w_dtype)] = fn
    return out


def supported_dtypes(activations: torch.dtype = torch.float32) -> frozenset[torch.dtype]:
    """Pool dtypes the native kernel handles here for `activations` (builds it on first use; raises
    NativeBuildError)."""
    return frozenset(w for x, w in _kernels() if x == activations)


def lora_bgmv_cpu(
    x: Tensor,  # [T, fin] float32, bfloat16 or float16; rows may be strided
    y: Tensor,  # [T, fout] x's dtype (e.g. one slice's columns of a packed output), updated in place
    a_pages: Tensor,  # [P, page_rank, fin] contiguous
    b_pages: Tensor,  # [P, fout, page_rank] contiguous
    page_rows: Tensor,  # [K] int64: page of pair k (index into the first dim of a_pages/b_pages)
    page_ranks: Tensor,  # [K] int32: rank rows of that page in use (rows beyond it are never read)
    row_starts: Tensor,  # [K] int64: first row (of x and y) of pair k's run; pairs sorted by run
    row_counts: Tensor,  # [K] int32: rows in that run
    scale: Tensor,  # [K] float32
    num_threads: int = 1,
    isa: str | None = None,  # instruction-set level (`available_isas()`); None: the best
) -> None:
    """For each pair k, r = page_ranks[k], and each row t of its run:
    ``y[t] += scale[k] * (A_k[:r] @ x[t]) @ B_k[:, :r].T`` (float32 sums; a half-precision y row rounded
    once per pair).

    Checks are on shapes, dtypes and layout only; page and row indices are trusted (the engine's plan
    builds them from the pool's page tables). The engine calls `PreparedBGMV`, checked once per plan.
    """
    kernels = _kernels(isa)
    _check(kernels, x, y, a_pages, b_pages, page_rows, page_ranks, row_starts, row_counts, scale)
    pr, fin, fout = a_pages.shape[1], a_pages.shape[2], b_pages.shape[1]
    rc = kernels[(x.dtype, a_pages.dtype)](
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a_pages.data_ptr(), b_pages.data_ptr(),
        page_rows.data_ptr(), page_ranks.data_ptr(), row_starts.data_ptr(), row_counts.data_ptr(),
        scale.data_ptr(), page_rows.shape[0], pr, fin, fout, num_threads,
    )  # fmt: skip
    if rc == -1:
        raise ValueError(f"{_OP}: page_rank {pr} out of range (1..256)")
    if rc != 0:
        raise ValueError(f"{_OP}: a run has more than 64 pages or 1024 rank rows on one slice")


class PreparedBGMV:
    """`lora_bgmv_cpu` for one slice at every layer, with everything but x and y fixed, checked once.

    The pairs' runs are the same at every layer; their pages, page ranks and scales are given per layer
    (`[L, K]`, row l for layer l). For a caller that applies the same pairs many times (the engine:
    every layer of every step while the batch composition holds): a call is then one foreign-function
    call, no tensor work. It keeps references to its tensors, so the pointers it holds stay valid.
    """

    def __init__(
        self,
        a_pages: Tensor,  # [P, page_rank, fin] contiguous
        b_pages: Tensor,  # [P, fout, page_rank] contiguous
        page_rows: Tensor,  # [L, K] int64, contiguous
        page_ranks: Tensor,  # [L, K] int32, contiguous
        row_starts: Tensor,  # [K] int64
        row_counts: Tensor,  # [K] int32
        scale: Tensor,  # [L, K] float32, contiguous
        num_threads: int = 1,
        activations: torch.dtype = torch.float32,  # dtype of the x and y it will be called with
    ) -> None:
        kernels = _kernels()
        pr, fin, fout = a_pages.shape[1], a_pages.shape[2], b_pages.shape[1]
        for name, t in (("page_rows", page_rows), ("page_ranks", page_ranks), ("scale", scale)):
            if t.dim() != 2 or t.shape != page_rows.shape or not t.is_contiguous():
                raise ValueError(f"{_OP}: {name} must be contiguous [layers, pairs] like page_rows")
        x, y = torch.empty(1, fin, dtype=activations), torch.empty(1, fout, dtype=activations)  # probes
        _check(kernels, x, y, a_pages, b_pages, page_rows[0], page_ranks[0], row_starts, row_counts, scale[0])
        self._keep = (a_pages, b_pages, page_rows, page_ranks, row_starts, row_counts, scale)
        self._fn = kernels[(activations, a_pages.dtype)]
        self.fin, self.fout, self._esize = fin, fout, x.element_size()
        k = page_rows.shape[1]
        self._args = [
            (
                a_pages.data_ptr(),
                b_pages.data_ptr(),
                page_rows[layer].data_ptr(),
                page_ranks[layer].data_ptr(),
                row_starts.data_ptr(),
                row_counts.data_ptr(),
                scale[layer].data_ptr(),
                k,
                pr,
                fin,
                fout,
                num_threads,
            )
            for layer in range(page_rows.shape[0])
        ]

    def __call__(self, layer: int, x: Tensor, y: Tensor, col: int = 0) -> None:
        """Add the LoRA of the pairs at `layer` into ``y[:, col : col + fout]``; x is ``[T, fin]``, x and y
        of the `activations` dtype with unit column stride (not checked: the caller owns both)."""
        self._fn(x.data_ptr(), x.stride(0), y.data_ptr() + self._esize * col, y.stride(0), *self._args[layer])


def _check(kernels: dict, x: Tensor, y: Tensor, a_pages: Tensor, b_pages: Tensor, *pair_args: Tensor) -> None:
    check_tensor(_OP, "x", x, ndim=2, dtypes=tuple(_SHORT))
    check_tensor(_OP, "y", y, ndim=2, dtypes=(x.dtype,))
    if (x.dtype, a_pages.dtype) not in kernels:
        raise ValueError(f"{_OP}: no native kernel for {x.dtype} activations and {a_pages.dtype} pages here")
    check_tensor(_OP, "a_pages", a_pages, ndim=3, dtypes=(a_pages.dtype,), contiguous=True)
    check_tensor(_OP, "b_pages", b_pages, ndim=3, dtypes=(a_pages.dtype,), contiguous=True)
    pr, fin, fout = a_pages.shape[1], a_pages.shape[2], b_pages.shape[1]
    if x.shape[1] != fin or y.shape[1] != fout or b_pages.shape[2] != pr or y.shape[0] != x.shape[0]:
        raise ValueError(
            f"{_OP}: shapes do not agree: x {tuple(x.shape)}, y {tuple(y.shape)}, "
            f"a_pages {tuple(a_pages.shape)}, b_pages {tuple(b_pages.shape)}"
        )
    k = pair_args[0].shape[0]
    names = ("page_rows", "page_ranks", "row_starts", "row_counts", "scale")
    dtypes = (torch.int64, torch.int32, torch.int64, torch.int32, torch.float32)
    for name, t, dtype in zip(names, pair_args, dtypes, strict=True):
        check_tensor(_OP, name, t, ndim=1, dtypes=(dtype,), contiguous=True)
        if t.shape[0] != k:
            raise ValueError(f"{_OP}: {name} has {t.shape[0]} entries, page_rows has {k}")
