"""Which code applies LoRA in the engine's steps: `select_lora_backend`.

- ``triton`` (CUDA): SGMV shrink/expand kernels over the page tables (`kernels/lora_shrink.py`, ...).
- ``native`` (CPU): every run (decode tokens, prefill chunks) by the compiled BGMV kernel
  (`kernels/lora_bgmv_cpu.py`), which reads the pool's pages in place.
- ``torch`` (CPU): everything in torch (decode rows gathered, then `bmm`; prefill chunks as GEMMs);
  needs no C compiler.

``auto`` picks triton on CUDA, and on CPU native when the kernel builds here and has the dtypes
(float32, bfloat16 or float16 activations and pages; float16 needs a compiler with `_Float16`), torch
otherwise.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "native", "triton")


def validate_lora_backend(name: str) -> str:
    """`name` if it is one of BACKENDS; else ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"lora backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


def select_lora_backend(
    name: str, device: torch.device, pool_dtype: torch.dtype, compute_dtype: torch.dtype
) -> str:
    """The backend to use for `name` on `device`; raises ValueError when the choice cannot work."""
    if validate_lora_backend(name) == "auto":
        name = "triton" if device.type == "cuda" else _cpu_default(pool_dtype, compute_dtype)
    if name == "triton" and pool_dtype != compute_dtype:
        raise ValueError(
            f"the triton LoRA backend needs lora_dtype equal to the model dtype ({compute_dtype}); "
            f"got {pool_dtype}"
        )
    if name == "native":
        problem = _native_problem(device, pool_dtype, compute_dtype)
        if problem:
            raise ValueError(f"lora backend 'native' is not available: {problem}")
    return name


def _cpu_default(pool_dtype: torch.dtype, compute_dtype: torch.dtype) -> str:
    problem = _native_problem(torch.device("cpu"), pool_dtype, compute_dtype)
    if problem is None:
        return "native"
    log.warning("LoRA on CPU uses the torch path: %s", problem)
    return "torch"


def _native_problem(device: torch.device, pool_dtype: torch.dtype, compute_dtype: torch.dtype) -> str | None:
    """Why the native kernel cannot serve this configuration, or None when it can."""
    if device.type != "cpu":
        return f"it runs on the CPU, the engine is on {device}"
    from kernels.lora_bgmv_cpu import supported_dtypes
    from kernels.native_build import NativeBuildError

    try:
        supported = supported_dtypes(compute_dtype)
    except NativeBuildError as exc:
        return str(exc)
    if pool_dtype not in supported:
        return f"no kernel for {compute_dtype} activations and {pool_dtype} pages with this C compiler"
    return None
