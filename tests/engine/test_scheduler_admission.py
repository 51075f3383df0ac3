"""Adapter-aware (resident-first) admission, model-free: the scheduler with a real KV cache manager and a
small stand-in for the device pool that does what `LoRAManager.prepare` does (upload the wanted adapters
in order, evicting least recently used ones that are neither in use nor wanted earlier)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.test_scheduler_unit import _ids, _run, _sched, _seq


class LRUPool:
    """`capacity` adapters; `prepare(wanted, in_use)` uploads like `LoRAManager.prepare`."""

    def __init__(self, capacity: int, resident: tuple[str, ...] = ()) -> None:
        self.capacity = capacity
        self.resident: OrderedDict[str, None] = OrderedDict((d, None) for d in resident)
        self.uploads = 0

    def is_resident(self, digest: str) -> bool:
        return digest in self.resident

    def prepare(self, wanted: list[str], in_use: set[str]) -> None:
        protected = set(in_use)
        for digest in wanted:
            if digest not in self.resident:
                if len(self.resident) >= self.capacity:
                    victims = [d for d in self.resident if d not in protected]
                    if not victims:
                        continue
                    del self.resident[victims[0]]
                self.resident[digest] = None
                self.uploads += 1
            protected.add(digest)

    def touch(self, plan: SchedulerOutput) -> None:
        for item in plan.scheduled:
            if item.seq.lora_key is not None:
                self.resident.move_to_end(item.seq.lora_key)


def _step(s: Scheduler, pool: LRUPool) -> SchedulerOutput:
    """One engine step: make the wanted adapters resident, schedule, run (hand-made tokens), update."""
    pool.prepare(s.adapters_wanted(), s.running_adapters())
    plan = s.schedule()
    pool.touch(plan)
    s.update(plan, _run(plan))
    return plan


def _drain(s: Scheduler, pool: LRUPool, max_steps: int = 2000) -> list[SchedulerOutput]:
    plans = []
    while s.has_unfinished():
        plans.append(_step(s, pool))
        assert len(plans) < max_steps, "the scheduler stopped making progress"
    return plans


@pytest.mark.parametrize("order", ["cyclic", "shuffled"])
def test_thrash_workload_reuses_resident_adapters(order):
    """8 adapters x 4 requests through a pool of 4 adapters, 2 running at a time: in policy order most
    requests upload their adapter (in cyclic order every one: it was evicted before it came round
    again); resident-first admission runs an adapter's requests while it is resident."""

    keys = [f"a{i % 8}" for i in range(32)]
    if order == "shuffled":
        random.Random(0).shuffle(keys)
    uploads, tokens = {}, {}
    for resident_first in (False, True):
        pool = LRUPool(capacity=4)
        s = _sched(max_num_seqs=2, max_loras=2, is_resident=pool.is_resident, resident_first=resident_first)
        seqs = [_seq(f"r{i}", 3, max_tokens=3, lora=k) for i, k in enumerate(keys)]
        for q in seqs:
            s.add_request(q)
        _drain(s, pool)
        uploads[resident_first] = pool.uploads
        tokens[resident_first] = [q.output_token_ids for q in seqs]
        assert s.kv.stats().num_used == 0 and all(q.is_finished for q in seqs)
    assert tokens[True] == tokens[False]  # every request ran to its end either way
    assert uploads[False] >= 16  # the policy order misses the pool for most requests
    assert uploads[True] <= uploads[False] // 2


def test_resident_adapters_are_wanted_and_admitted_first():
    pool = LRUPool(capacity=2, resident=("y",))
    s = _sched(max_loras=2, is_resident=pool.is_resident)
    cold, warm, base = _seq("cold", 3, lora="x"), _seq("warm", 3, lora="y"), _seq("base", 3)
    for q in (cold, warm, base):
        s.add_request(q)
    assert s.adapters_wanted() == ["y", "x"]  # y first: an upload of x may not evict it
    plan = s.schedule()
    assert [sid for sid, _ in _ids(plan)] == ["warm", "base"]
    assert cold.num_admission_bypasses == 1  # passed over by the requests behind it


def test_nothing_changes_when_every_adapter_is_resident():
    """Same plans with and without resident-first admission when every adapter is resident, under each
    policy (priorities and prefix-cache hits included)."""
    for policy in ("fcfs", "priority", "lpm"):
        runs = []
        for resident_first in (True, False):
            s = _sched(max_num_seqs=3, max_loras=2, budget=10, policy=policy, resident_first=resident_first)
            for i in range(9):
                q = _seq(f"r{i}", 3 + i % 4, max_tokens=2 + i % 3, lora=f"a{i % 3}", arrival=float(i))
                q.priority = (i * 7) % 3
                s.add_request(q)
            runs.append([_ids(p) for p in _drain(s, LRUPool(capacity=3, resident=("a0", "a1", "a2")))])
        assert runs[0] == runs[1], policy


def test_bounded_wait_under_a_steady_stream_of_resident_requests():
    """A request whose adapter is not resident, behind a stream of requests whose adapter is: it is
    deferred for `max_bypass_steps` steps, then its adapter is wanted first and it runs."""
    bound = 3
    pool = LRUPool(capacity=1, resident=("x",))  # room for one adapter: loading z must evict x
    s = _sched(max_num_seqs=1, max_loras=1, is_resident=pool.is_resident, max_bypass_steps=bound)
    cold = _seq("cold", 3, max_tokens=1, lora="z")
    s.add_request(cold)
    admitted_at = None
    for step in range(20):
        s.add_request(_seq(f"x{step}", 3, max_tokens=1, lora="x"))
        plan = _step(s, pool)
        if cold in [it.seq for it in plan.scheduled]:
            admitted_at = step
            break
        assert [sid for sid, _ in _ids(plan)] == [f"x{step}"]
    assert admitted_at == bound  # deferred for exactly `bound` steps, then its adapter was loaded
    assert cold.num_admission_bypasses == bound

    # without the bound the stream keeps it waiting: the bound is what admits it
    pool = LRUPool(capacity=1, resident=("x",))
    s = _sched(max_num_seqs=1, max_loras=1, is_resident=pool.is_resident, max_bypass_steps=10**9)
    cold = _seq("cold", 3, max_tokens=1, lora="z")
    s.add_request(cold)
    for step in range(20):
        s.add_request(_seq(f"x{step}", 3, max_tokens=1, lora="x"))
        _step(s, pool)
    assert not cold.is_finished and cold.num_admission_bypasses == 20


def test_priority_is_kept_across_residency():
    """Resident-first reorders only within a priority: a resident request of lower priority never gets
    its adapter wanted before a more important one's."""
    pool = LRUPool(capacity=4, resident=("y", "w"))
    s = _sched(policy="priority", max_loras=2, is_resident=pool.is_resident)
    for sid, lora, prio in (("lo", "y", 1), ("hi-cold", "z", 0), ("hi-warm", "w", 0)):
        q = _seq(sid, 3, lora=lora)
        q.priority = prio
        s.add_request(q)
    assert s.adapters_wanted() == ["w", "z", "y"]
    s_off = _sched(policy="priority", max_loras=2, is_resident=pool.is_resident, resident_first=False)
    for q in list(s.waiting):
        s_off.add_request(q)
    assert s_off.adapters_wanted() == ["z", "w"]  # policy order, the free slots only


def test_preempted_request_is_never_deferred():
    """A preempted request whose adapter was evicted meanwhile keeps its place at the front."""
    pool = LRUPool(capacity=3, resident=("x", "y", "w"))
    s = _sched(num_blocks=3, block_size=4, max_loras=3, is_resident=pool.is_resident)
    old, new = _seq("old", 4, max_tokens=8, lora="x"), _seq("new", 4, max_tokens=8, lora="y")
    s.add_request(old)
    s.add_request(new)
    s.update(plan := s.schedule(), _run(plan))
    plan = s.schedule()
    assert plan.preempted == [new]
    s.update(plan, _run(plan))
    del pool.resident["y"]  # evicted while `new` waits
    later = _seq("later", 3, lora="w")  # resident, arrived after
    s.add_request(later)
    assert s.adapters_wanted()[:2] == ["y", "w"]
    assert s.waiting == [new, later] and new.num_admission_bypasses == 0


def test_unresolved_adapter_is_deferred_too():
    """A request whose adapter digest is not known yet cannot run; it does not hold up the others'
    adapters either."""
    pool = LRUPool(capacity=2, resident=("y",))
    s = _sched(max_loras=1, is_resident=pool.is_resident)
    pending = _seq("pending", 3, lora="x")
    pending.lora_key = None
    s.add_request(pending)
    s.add_request(_seq("warm", 3, lora="y"))
    assert s.adapters_wanted() == ["y"]
    assert [sid for sid, _ in _ids(s.schedule())] == ["warm"]
    assert pending.num_admission_bypasses == 1
