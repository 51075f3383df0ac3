"""`bench.common.settle.wait_quiet`: a peer benchmark's next leg waits while the other engine's process tree
(a busy grandchild included) still burns CPU, and not when everything is idle."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common.settle import cpu_seconds, process_tree, wait_quiet

# A parent that starts a child spinning until it has used `SPIN_S` seconds of CPU, then both sleep: like
# an engine whose worker process busy-polls for a while after its last batch. (CPU time, not wall time:
# on a loaded machine the spin then lasts longer instead of ending before it was ever seen.)
SPIN_S = 0.6
CHILD = f"import time\nwhile time.process_time() < {SPIN_S}: pass\ntime.sleep(60)"
PARENT = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}])\n"
    "print('started', flush=True)\n"
    "time.sleep(60)\n"
)


def test_waits_for_a_busy_descendant_then_returns():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        t0 = time.perf_counter()
        tree = process_tree(proc.pid)
        assert len(tree) == 2 and tree[0] == proc.pid  # the parent and its spinning child
        # a low threshold: a spinner shares the cores with other jobs when the machine is loaded
        waited = wait_quiet([proc.pid], threshold=0.02, max_s=60.0)
        assert waited < 60.0, waited  # it returned because the spin ended, not at max_s
        assert cpu_seconds(tree[1:]) >= 0.9 * SPIN_S  # ... and only once the child had (nearly) spun out
        assert time.perf_counter() - t0 >= 0.4
        c0 = cpu_seconds(tree)
        time.sleep(0.3)
        assert cpu_seconds(tree) - c0 < 0.05  # the tree is quiet now
    finally:
        for pid in process_tree(proc.pid)[::-1]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait(timeout=10)


def test_idle_processes_cost_one_window():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # past the interpreter's start-up
        assert wait_quiet([proc.pid], window_s=0.2) < 0.6
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_gone_processes_count_nothing():
    assert cpu_seconds([2**22 + 12345]) == 0.0
    assert process_tree(2**22 + 12345) == [2**22 + 12345]
