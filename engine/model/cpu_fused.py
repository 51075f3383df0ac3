"""Whether a forward pass uses the fused native elementwise ops on the CPU (`kernels/fused_cpu.py`).

On the CPU the decoder's small ops (residual add + RMSNorm, RoPE on q and k, SiLU(gate) * up) run as
one native call each instead of several torch ops; same results as the torch formula (see the kernels).
The torch path stays for CUDA tensors, for dtypes the library lacks, and when the library cannot be
built here (no C compiler): then a warning is logged once and the torch ops are used.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def native_dtypes() -> frozenset[torch.dtype]:
    """Dtypes the fused CPU kernels handle here; empty when the library does not build (logged once)."""
    from kernels.fused_cpu import supported_dtypes
    from kernels.native_build import NativeBuildError

    try:
        return supported_dtypes()
    except NativeBuildError as exc:
        log.warning("fused CPU ops unavailable, using torch ops: %s", exc)
        return frozenset()


def use_fused(x: torch.Tensor, enabled: bool = True) -> bool:
    """True when a forward pass over activations like `x` takes the fused CPU path."""
    return enabled and x.device.type == "cpu" and x.dtype in native_dtypes()
