"""Decode rows' expert-LoRA deltas on the CPU (``csrc/moe_gemm_cpu.c``'s `moe_lora_pairs`) and their
launcher.

`lora_pairs_cpu(x, a, b, pages, rows, scales, out)` adds, for each pair k,
``out[rows[k]] += scales[k] * (x[rows[k]] @ a_pages[pages[k]].T) @ b_pages[pages[k]].T`` reading each
pair's A page ``[page_rank, in]`` and B page ``[out, page_rank]`` where it lies in the pool (the torch path
gathers copies of them first). Float32 only; the library is the MoE GEMM's (same instruction-set levels).
Threads: torch's intra-op count at the call.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from kernels.moe_gemm_cpu import _library
from kernels.native_build import isa_entry

_I64, _VP, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGS = [_VP, _I64, _VP, _VP, _I64, _I64, _I64, _VP, _VP, _VP, _I64, _VP, _I64, _INT]
_OP = "lora_pairs_cpu"


@functools.cache
def _entry(isa: str | None):
    return isa_entry(_library(), _OP, "moe_lora_pairs_float", isa, _ARGS)


def supported_dtypes() -> frozenset[torch.dtype]:
    """Dtypes the kernel takes (builds the library on first use; raises NativeBuildError)."""
    _entry(None)
    return frozenset({torch.float32})


def lora_pairs_cpu(
    x: Tensor,  # [R, in] float32, last dim contiguous
    a_pages: Tensor,  # [N, page_rank, in] float32 contiguous: every (page, layer, expert)'s A rows
    b_pages: Tensor,  # [N, out, page_rank] float32 contiguous: the same entries' B columns
    pages: Tensor,  # [P] int64 on the CPU: each pair's entry in a_pages / b_pages
    rows: Tensor,  # [P] int64: each pair's row of x and out
    scales: Tensor,  # [P] float32: each pair's LoRA scaling
    out: Tensor,  # [R, out] float32, last dim contiguous: added to in place
    isa: str | None = None,
) -> None:
    """Each pair's LoRA delta into `out` (module docstring); ValueError for tensors it does not take."""
    ts = (x, a_pages, b_pages, out, scales)
    if any(t.dtype != torch.float32 for t in ts) or any(t.device.type != "cpu" for t in (*ts, pages, rows)):
        raise ValueError(f"{_OP}: float32 CPU tensors only")
    n, pr, fin = a_pages.shape
    fout = b_pages.shape[1]
    if b_pages.shape != (n, fout, pr) or x.dim() != 2 or x.shape[1] != fin or out.dim() != 2:
        raise ValueError(
            f"{_OP}: shapes x {tuple(x.shape)}, A {tuple(a_pages.shape)}, B {tuple(b_pages.shape)}"
        )
    if out.shape != (x.shape[0], fout) or not (a_pages.is_contiguous() and b_pages.is_contiguous()):
        raise ValueError(f"{_OP}: out must be [{x.shape[0]}, {fout}] and the pages contiguous")
    if (x.shape[0] and x.stride(1) != 1) or (out.shape[0] and out.stride(1) != 1):
        raise ValueError(f"{_OP}: x and out must be contiguous in their last dim")
    count = pages.shape[0]
    for t, name in ((pages, "pages"), (rows, "rows"), (scales, "scales")):
        if t.shape != (count,) or not t.is_contiguous():
            raise ValueError(f"{_OP}: {name} must be a contiguous [{count}] tensor")
    if pages.dtype != torch.int64 or rows.dtype != torch.int64:
        raise ValueError(f"{_OP}: pages and rows must be int64")
    if count and not (int(pages.min()) >= 0 and int(pages.max()) < n):
        raise ValueError(f"{_OP}: a page index is outside the {n} pages")
    if count and not (int(rows.min()) >= 0 and int(rows.max()) < x.shape[0]):
        raise ValueError(f"{_OP}: a row index is outside the {x.shape[0]} rows")
    rc = _entry(isa)(
        x.data_ptr(), x.stride(0), a_pages.data_ptr(), b_pages.data_ptr(), pr, fin, fout, pages.data_ptr(),
        rows.data_ptr(), scales.data_ptr(), count, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"{_OP}: out of memory")
