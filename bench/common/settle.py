"""Wait for the engines of a side-by-side benchmark to go idle before the next leg is timed.

An engine keeps burning CPU for a while after its last request: OpenMP workers spin before they sleep,
and vLLM's CPU engine busy-polls for about a second after a batch (measured: ~1 CPU-second in the first
idle second, then nothing). A leg started in that window shares its cores with the previous engine and
is timed slow for a reason that is not its own; loraplex's thread governor even reads the stolen time
as contention and drops to one thread. `wait_quiet` waits until the given process trees (and this
process's other threads) use less than `threshold` of a core, so every leg starts on a quiet machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (by the parent pids in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes `pids` have used so far (gone processes count 0)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICK


def wait_quiet(
    roots: Iterable[int], threshold: float = 0.1, window_s: float = 0.2, max_s: float = 5.0
) -> float:
    """Sleep until the process trees under `roots` and this process together use under `threshold`
    cores over a `window_s` window (this thread sleeps meanwhile, so only busy helpers count), or for
    `max_s` at most; returns the seconds waited."""
    t0 = time.perf_counter()
    pids = [p for r in roots for p in process_tree(r)]
    if os.getpid() not in pids:
        pids.append(os.getpid())
    while True:
        c0, w0 = cpu_seconds(pids), time.perf_counter()
        time.sleep(window_s)
        busy = (cpu_seconds(pids) - c0) / (time.perf_counter() - w0)
        waited = time.perf_counter() - t0
        if busy < threshold or waited >= max_s:
            return waited
