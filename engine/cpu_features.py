"""What this CPU computes natively, for choices made on its behalf (the `dtype="auto"` of a CPU engine)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# /proc/cpuinfo flags that mean bfloat16 products in hardware: x86 AVX-512 BF16 and AMX BF16, Arm BF16.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (x86 `flags`, Arm `Features`); empty if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bfloat16() -> str | None:
    """The flag by which this CPU multiplies bfloat16 natively (e.g. "avx512_bf16"), or None when it has
    to emulate it (then bfloat16 matmuls are slower than float32 ones)."""
    flags = cpu_flags()
    found = [f for f in _BF16_FLAGS if f in flags]
    if found and (found[0] != "bf16" or platform.machine().lower() in ("aarch64", "arm64")):
        return found[0]
    return None
