"""CPU hogs for contention benchmarks: `cpu_hogs(n)` runs n busy processes for the length of a block.

Each hog is a separate Python process spinning on arithmetic (no memory traffic to speak of), so the
benchmarked engine competes for cores the way it does beside a noisy neighbour. Hogs are bounded twice:
they are killed when the block ends, and each exits by itself after `max_s` seconds should the benchmark
die without cleaning up.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

_SPIN = (
    "import time\n"
    "end = time.monotonic() + {max_s}\n"
    "x = 0\n"
    "while time.monotonic() < end:\n"
    "    x = (x * 7 + 1) % 1000003\n"
)


@contextlib.contextmanager
def cpu_hogs(n: int, max_s: float = 900.0) -> Iterator[list[int]]:
    """Start `n` busy processes (their pids are yielded), kill them when the block exits."""
    if n < 0 or n > 4 * (os.cpu_count() or 1):
        raise ValueError(f"hog count must be in 0..{4 * (os.cpu_count() or 1)}, got {n}")
    procs = [
        subprocess.Popen([sys.executable, "-c", _SPIN.format(max_s=float(max_s))], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS does not report them)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def cpu_summary() -> str:
    """'<model name>, N logical CPUs, <ISA flags that matter here>' from /proc/cpuinfo."""
    from pathlib import Path

    from engine.cpu_features import cpu_flags

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return f"{name}, {os.cpu_count()} logical CPUs, {' '.join(isa) or 'no AVX2'}"
