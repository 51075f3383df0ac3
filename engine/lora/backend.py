"""Which code applies LoRA in the engine's steps: `select_lora_backend`.

- ``triton`` (CUDA): SGMV shrink/expand kernels over the page tables (`kernels/lora_shrink.py`, ...).
- ``native`` (CPU): every run (decode tokens, prefill chunks) by the compiled BGMV kernel
  (`kernels/lora_bgmv_cpu.py`), which reads the pool's pages in place.
- ``torch`` (CPU): everything in torch (decode rows gathered, then `bmm`; prefill chunks as GEMMs);
  needs no C compiler.

``auto`` picks triton on CUDA, and on CPU native when the kernel builds here and has the dtypes
(float32, bfloat16 or float16 activations and pages; float16 needs a compiler with `_Float16`), torch
otherwise.

On the triton backend a step uses one of two kernels, by the one rule `lora_kernel_for`:

- ``bgmv`` (`kernels/lora_bgmv.py`): shrink and expand fused in one launch per packed projection, for
  steps where every adapter has at most `BGMV_MAX_ROWS` rows (decode). A program holds a few rows of
  one adapter and computes their ``rows x rank`` intermediate on chip (rank in chunks of up to 32), so no
  16-row tensor-core tile is padded from 1-8 rows and the intermediate never goes to memory.
- ``sgmv`` (`kernels/lora_shrink.py` then `kernels/lora_expand.py`): tensor-core tiles of 16-64 rows,
  for steps with a longer run on one adapter (prefill chunks, many decodes of one adapter).

A step with no adapter row has no LoRA context at all (`AdapterResidency.step_context` returns None), so
it launches no LoRA kernel, eagerly and in CUDA graphs (`engine/decode_graphs.py` keeps a graph per
bucket and kernel: none, bgmv, sgmv).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.pool import AdapterPool
    from kernels.lora_meta import LoRABatchMeta

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "native", "triton")
TRITON_KERNELS = ("bgmv", "sgmv")
# The most rows one adapter may have in a step for the fused BGMV kernel: the smallest SGMV tile. At or
# below it a tensor-core tile is mostly padding; above it the tile's reuse of each weight pays.
BGMV_MAX_ROWS = 16


def lora_kernel_for(max_rows_per_adapter: int) -> str:
    """The Triton LoRA kernel of a step whose largest run on one adapter has `max_rows_per_adapter` rows:
    ``"bgmv"`` when it is at most `BGMV_MAX_ROWS`, else ``"sgmv"`` (module docstring)."""
    return "bgmv" if max_rows_per_adapter <= BGMV_MAX_ROWS else "sgmv"


def max_rows_per_adapter(slots: Sequence[int]) -> int:
    """The most flat-batch rows that share one adapter slot (slot -1, no adapter, not counted)."""
    counts = Counter(s for s in slots if s >= 0)
    return max(counts.values(), default=0)


def apply_triton_lora(
    pool: AdapterPool,
    meta: LoRABatchMeta,
    kernel: str,
    layer: int,
    mods: range,  # module indices of the packed projection's slices (consecutive)
    x: torch.Tensor,  # [T, H_in]
    y: torch.Tensor,  # [T, sum of the slices' H_out], updated in place
) -> None:
    """``y[t, slice s] += scaling * (x[t] @ A.T) @ B.T`` for every row with an adapter, by `kernel`
    (``"bgmv"``: one fused launch; ``"sgmv"``: shrink into a float32 ``[slices, T, max_rank]`` buffer,
    then expand) over the pool's page tables at `layer`."""
    from kernels.lora_bgmv import lora_bgmv
    from kernels.lora_expand import lora_expand
    from kernels.lora_shrink import lora_shrink

    sl = slice(mods.start, mods.stop)
    page_table, ranks, scalings = pool.page_table[sl], pool.ranks[layer, sl], pool.scalings[layer, sl]
    a_pools = [pool.a[m][:, layer] for m in mods]
    b_pools = [pool.b[m][:, layer] for m in mods]
    if kernel == "bgmv":
        lora_bgmv(x, a_pools, b_pools, page_table, ranks, scalings, meta, y)
        return
    assert kernel == "sgmv", f"unknown Triton LoRA kernel {kernel!r}"
    max_rank = pool.max_pages_per_adapter * pool.page_rank
    v = torch.empty(len(mods), x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    lora_shrink(x, a_pools, page_table, ranks, meta, v)
    lora_expand(v, b_pools, page_table, ranks, scalings, meta, y)


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
