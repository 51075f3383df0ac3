"""How many threads a CPU engine computes with, and `ThreadGovernor`, which drops them under contention.

Why: torch's CPU ops (and the native LoRA kernel) split each op between OpenMP threads that meet at a
barrier at its end. When another process holds a core, one of the threads is descheduled and every op
waits for it to get the core back (a scheduler time slice, milliseconds) — hundreds of times per step:
with two threads beside two busy processes on two cores, a decode step was 5-8x slower than with one
thread (docs/benchmarks.md). One thread has no barrier; it just gets its share of a core.

- `available_cpus()`: the CPUs this process may run on (affinity mask), capped by a cgroup CPU quota
  (a container limited to 1.5 CPUs on a 64-core host must not start 64 threads).
- `ThreadGovernor`: per step, the process's CPU time over (wall time x threads) is its *CPU share*:
  near 1 while its threads have their cores (time spinning at barriers counts), lower when they are
  descheduled. Below `low` over a window, the engine drops to one thread; while at one thread with a
  share above `high` (a whole core to itself), it tries its full count again after a wait that starts
  at `retry_s` (1 s) and doubles, up to `max_retry_s` (30 s), each time a retry is met by contention
  within `confirm_s`: a short burst from a neighbour costs about a second at one thread, a lasting one
  a failed retry window every 30 s.

A low share alone does not tell a neighbour from a step's serial parts (Python, small ops) during which
the other threads sleep: an expert-LoRA batch on 2 cores had a share under `low` with no other process
running, and dropping to one thread made its steps 1.6x slower. So a drop also needs the kernel's own
word that the threads waited for a core: their run-queue wait (`/proc/self/task/*/schedstat`, read once
per window) over the window's elapsed time x threads at least `min_wait` (0.05). Where the kernel does
not report it, the share alone decides, as before.

Under tensor parallel rank 0's governor decides for every rank: the workers take its thread count from
each step's plan (`engine/distributed/step_plan.py`), so all ranks change together (the slowest sets the
pace of every collective). Its `overhead` (the collectives' own cost, `WorkerGroup.collective_cost`) is
not counted as wall time, while time spent waiting for a descheduled rank is: a contended worker lowers
rank 0's share as a contended rank 0 does.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup (v2 or v1) CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota() -> float | None:
    """The CPU quota in CPUs (quota / period), or None when unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]  # cgroup v2
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        root = Path("/sys/fs/cgroup/cpu")
        quota_us = int((root / "cpu.cfs_quota_us").read_text())
        return None if quota_us <= 0 else quota_us / int((root / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU since they started (the
    sum of /proc/self/task/*/schedstat's second field), or None where the kernel does not report it."""
    total, seen = 0, False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile, or no schedstat
            continue
    return total / 1e9 if seen else None


class ThreadGovernor:
    """Sets torch's intra-op threads between 1 and `max_threads` from the CPU share of recent steps.

    Call `begin()` before and `end()` after each step; `end` may change `torch.get_num_threads()` (the
    native LoRA plans key on it, so they follow). Decisions are made per window of at least `window_s`
    seconds and `window_steps` steps, so a single odd step changes nothing.
    """

    def __init__(
        self,
        max_threads: int,
        low: float = 0.75,
        high: float = 0.9,
        window_s: float = 0.25,
        window_steps: int = 4,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        confirm_s: float = 2.0,
        overhead: Callable[[], float] | None = None,
        min_wait: float = 0.05,
        wait_clock: Callable[[], float | None] = runqueue_wait_s,
    ) -> None:
        self.max_threads, self.low, self.high = max_threads, low, high
        # under tensor parallel (`overhead`) the threads that wait may be a worker's, whose run-queue
        # wait this process's schedstat does not show: there the share alone decides
        self.min_wait = min_wait
        self.wait_clock = wait_clock if overhead is None else (lambda: None)
        self.last_wait: float | None = None  # the last window's run-queue wait share (None: not reported)
        self._w0: float | None = None
        self._window_t0 = 0.0
        self.window_s, self.window_steps = window_s, window_steps
        self.retry_s, self.max_retry_s, self.confirm_s = retry_s, max_retry_s, confirm_s
        self.threads = torch.get_num_threads()
        self.changes = 0  # how often the count was changed (for stats and tests)
        self.last_share: float | None = None
        self.wait_s = retry_s  # the wait at one thread before the next retry (module docstring)
        self._wall = self._cpu = 0.0
        self._steps = 0
        self._t0 = self._c0 = 0.0
        self._dropped_at = self._raised_at = -math.inf
        # a running total of seconds per step that are not this process's compute (module docstring)
        self.overhead = overhead
        self._o0 = 0.0

    def begin(self) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        if self._steps == 0:  # a window starts: its run-queue wait is measured from here
            self._window_t0, self._w0 = self._t0, self.wait_clock()
        self._o0 = self.overhead() if self.overhead is not None else 0.0

    def end(self) -> None:
        wall = time.perf_counter() - self._t0
        if self.overhead is not None:  # clamped: the total restarts with a restarted group
            wall -= min(max(0.0, self.overhead() - self._o0), wall)
        self._wall += wall
        self._cpu += time.process_time() - self._c0
        self._steps += 1
        if self._wall <= 0.0 or self._wall < self.window_s or self._steps < self.window_steps:
            return
        share = self._cpu / (self._wall * self.threads)
        self.last_share = share
        w1 = self.wait_clock() if self._w0 is not None else None
        elapsed = time.perf_counter() - self._window_t0
        waited = None
        if w1 is not None and self._w0 is not None and elapsed > 0:
            waited = (w1 - self._w0) / (elapsed * self.threads)
        self.last_wait = waited
        self._wall = self._cpu = 0.0
        self._steps = 0
        self.decide(share, time.monotonic(), waited)

    def decide(self, share: float, now: float, waited: float | None = None) -> None:
        """Apply the rule in the module docstring to one window's CPU share and run-queue wait share
        (`waited`, None: not reported, the share alone decides)."""
        contended = waited is None or waited >= self.min_wait
        if self.threads > 1 and share < self.low and contended:
            failed_retry = now - self._raised_at <= self.confirm_s
            self.wait_s = min(2 * self.wait_s, self.max_retry_s) if failed_retry else self.retry_s
            self._set(1)
            self._dropped_at = now
        elif (
            self.threads == 1 < self.max_threads
            and share > self.high
            and now - self._dropped_at > self.wait_s
        ):
            self._set(self.max_threads)
            self._raised_at = now

    def _set(self, n: int) -> None:
        torch.set_num_threads(n)
        self.threads = n
        self.changes += 1
