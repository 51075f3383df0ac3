"""Thread count under CPU contention: the CPUs a process may use, and the governor's rule."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.cpu_threads import ThreadGovernor, available_cpus


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_available_cpus_is_within_the_affinity_mask():
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def test_governor_drops_to_one_thread_and_retries_later(restore_threads):
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, low=0.75, high=0.9, retry_s=5.0)
    gov.decide(0.95, now=0.0)  # has its cores: keeps 2
    assert torch.get_num_threads() == 2 and gov.changes == 0
    gov.decide(0.5, now=1.0)  # threads descheduled: one thread
    assert torch.get_num_threads() == 1 and gov.threads == 1
    gov.decide(0.95, now=3.0)  # a whole core again, but too soon to retry
    assert torch.get_num_threads() == 1
    gov.decide(0.6, now=7.0)  # one thread that does not get a whole core: stays at 1
    assert torch.get_num_threads() == 1
    gov.decide(0.95, now=7.5)  # quiet again, retry_s after the drop: back to 2
    assert torch.get_num_threads() == 2 and gov.changes == 2
    gov.decide(0.4, now=8.0)  # contention again: down
    assert torch.get_num_threads() == 1 and gov.changes == 3


def test_governor_backs_off_while_retries_fail_and_recovers_fast_after_a_burst(restore_threads):
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, retry_s=1.0, max_retry_s=8.0, confirm_s=2.0)
    gov.decide(0.5, now=0.0)  # a neighbour takes a core: one thread, retry after 1 s
    assert gov.threads == 1 and gov.wait_s == 1.0
    t = 0.0
    waits = []
    for _ in range(5):  # lasting contention: each retry meets it in its first window
        t += gov.wait_s + 0.1
        gov.decide(0.95, now=t)
        assert gov.threads == 2
        t += 0.25
        gov.decide(0.5, now=t)
        assert gov.threads == 1
        waits.append(gov.wait_s)
    assert waits == [2.0, 4.0, 8.0, 8.0, 8.0]  # doubled, capped at max_retry_s
    gov.decide(0.95, now=t + 0.5)  # quiet again, but the wait is 8 s now: not yet
    assert gov.threads == 1
    t += 8.1
    gov.decide(0.95, now=t)  # the retry holds past confirm_s ...
    gov.decide(0.95, now=t + 3.0)
    assert gov.threads == 2
    gov.decide(0.5, now=t + 10.0)  # ... so the next burst starts again from retry_s
    assert gov.threads == 1 and gov.wait_s == 1.0
    gov.decide(0.95, now=t + 11.2)  # back to two threads about a second after the burst
    assert gov.threads == 2


def test_governor_decides_per_window_from_measured_shares(restore_threads):
    """A window's share is measured; a low one drops to one thread only when the threads also waited for
    a core (run-queue wait), not when the step was merely serial (the other thread asleep)."""
    waited = {"s": 0.0}
    for contended, threads_after in ((False, 2), (True, 1)):
        torch.set_num_threads(2)
        waited["s"] = 0.0
        gov = ThreadGovernor(2, window_s=0.0, window_steps=3, wait_clock=lambda: waited["s"])
        for _ in range(2):
            gov.begin()
            gov.end()
        assert gov.last_share is None  # fewer steps than a window
        gov.begin()
        sum(i * i for i in range(20000))  # one thread busy: at most about half of two threads' time
        if contended:
            waited["s"] += 1.0  # the threads spent a second runnable but off their cores
        gov.end()
        assert gov.last_share is not None and gov.last_share < 0.75
        assert torch.get_num_threads() == gov.threads == threads_after, contended
        assert (gov.last_wait > 0.05) == contended


def test_governor_keeps_its_threads_through_serial_work_on_an_idle_machine(restore_threads):
    """The real run-queue clock: a step of single-threaded Python beside no other process lowers the share
    but the threads never waited for a core, so the governor keeps both (it dropped them before)."""
    from engine.cpu_threads import runqueue_wait_s

    if runqueue_wait_s() is None:
        pytest.skip("this kernel does not report run-queue waits")
    seen = []
    # windows spread over about 10 s: under `-n 2` the other worker's test may hold both cores for seconds
    for attempt in range(40):
        if attempt:
            time.sleep(0.25)
        torch.set_num_threads(2)
        gov = ThreadGovernor(2, window_s=0.0, window_steps=1)
        gov.begin()
        sum(i * i for i in range(200000))
        gov.end()
        assert gov.last_share is not None and gov.last_share < 0.75 and gov.last_wait is not None
        assert gov.threads == (1 if gov.last_wait >= gov.min_wait else 2)  # the rule, either way
        seen.append(gov.last_wait < gov.min_wait)
        if seen[-1]:
            break
    assert any(seen), "every window waited for a core: no serial window on an idle core to judge"


def test_governor_drops_beside_real_busy_processes(restore_threads):
    """Two processes spinning on this machine's cores: the window's run-queue wait is real and the share
    low, so the governor drops to one thread."""
    import subprocess
    import time

    from engine.cpu_threads import runqueue_wait_s

    if runqueue_wait_s() is None:
        pytest.skip("this kernel does not report run-queue waits")
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, window_s=0.0, window_steps=1)
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(max(2, os.cpu_count() or 2))]
    try:
        time.sleep(0.2)
        gov.begin()
        x = torch.randn(256, 256)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            x = torch.tanh(x @ x * 0.01)
        gov.end()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert gov.last_wait is not None and gov.last_wait >= 0.05, (gov.last_share, gov.last_wait)
    assert gov.threads == 1


def test_governor_under_tensor_parallel_does_not_count_the_collectives_cost(restore_threads, monkeypatch):
    """Rank 0's governor (TP): the collectives' own cost (`overhead`) leaves the step's wall time, so a
    step that is half all-reduce at full CPU keeps its threads; waiting for a slow rank (not in
    `overhead`) lowers the share and drops every rank to one thread."""
    import engine.cpu_threads as ct

    clock = {"wall": 0.0, "cpu": 0.0, "cost": 0.0}
    monkeypatch.setattr(ct.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(ct.time, "process_time", lambda: clock["cpu"])
    torch.set_num_threads(2)
    gov = ThreadGovernor(2, window_s=0.0, window_steps=1, overhead=lambda: clock["cost"])

    def step(compute: float, collective: float, waited: float) -> None:  # binary fractions: exact sums
        gov.begin()
        clock["wall"] += compute + collective + waited
        clock["cpu"] += 2 * compute  # both threads busy while computing, idle in the collectives
        clock["cost"] += collective
        gov.end()

    step(compute=0.125, collective=0.125, waited=0.0)
    assert gov.last_share == pytest.approx(1.0) and gov.threads == 2
    step(compute=0.125, collective=0.125, waited=0.125)  # the other rank was descheduled
    assert gov.last_share == pytest.approx(0.5) and gov.threads == 1
    clock["cost"] = 5.0
    gov.begin()
    clock["cost"] = 0.0  # the group restarted mid-step, its counters with it: no negative cost
    clock["wall"] += 0.125
    clock["cpu"] += 0.125  # one thread, busy
    gov.end()
    assert gov.last_share == pytest.approx(1.0)
    share = gov.last_share
    step(compute=0.0, collective=0.125, waited=0.0)  # all cost, no compute: no window to judge
    assert gov.last_share == share and gov.threads == 1


def test_engine_uses_the_governor_on_cpu_unless_told_not_to(checkpoint, restore_threads):
    from engine import LLMEngine

    ckpt = checkpoint("llama")
    eng = LLMEngine.from_args(str(ckpt), device="cpu", dtype="float32", num_threads=2)
    assert eng.thread_governor is not None and eng.thread_governor.max_threads == 2
    fixed = LLMEngine.from_args(
        str(ckpt), device="cpu", dtype="float32", num_threads=2, adaptive_threads=False
    )
    assert fixed.thread_governor is None
    one = LLMEngine.from_args(str(ckpt), device="cpu", dtype="float32", num_threads=1)
    assert one.thread_governor is None  # nothing to drop
