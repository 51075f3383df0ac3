"""The scheduler alone: no model, a real KV cache manager, and hand-made runner outputs.

Each test builds sequences directly, calls `schedule()`, checks the plan, and feeds `update()` the tokens
a runner would have sampled, so admission, chunking, preemption, stop conditions and adapter limits are
checked in milliseconds.
"""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.scheduler.output import RunnerOutput, SampledToken
from engine.sequence import Sequence, SequenceStatus

EOS = 2


def _sched(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_loras: int = 8,
    policy: str = "fcfs",
    is_resident=None,
    lora_starvation_steps: int = 16,
    **config,
) -> Scheduler:
    """A scheduler over a real KV cache manager; `config`: further `SchedulerConfig` fields."""
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        max_loras=max_loras,
        lora_starvation_steps=lora_starvation_steps,
        **config,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), (EOS,), is_resident=is_resident)


def _seq(
    sid: str, prompt_len: int, max_tokens: int = 4, lora: str | None = None, arrival: float = 0.0, **params
) -> Sequence:
    lr = LoRARequest(lora, f"/adapters/{lora}") if lora else None
    prompt = [10 + (sum(map(ord, sid)) + i) % 50 for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(sid, prompt, sp, arrival, lora_request=lr, lora_key=lora, max_total_tokens=1000)


def _run(plan: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """What a runner returns: `token` for every item that samples, None for partial prefill chunks."""
    return RunnerOutput([SampledToken(token) if it.sample else None for it in plan.scheduled])


def _ids(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return [(it.seq.seq_id, it.num_tokens) for it in plan.scheduled]


def test_decodes_first_then_chunked_prefill_within_budget():
    s = _sched(budget=8)
    a = _seq("a", 5)
    s.add_request(a)
    plan = s.schedule()
    assert _ids(plan) == [("a", 5)] and plan.scheduled[0].sample
    assert s.update(plan, _run(plan)) == [a] and a.output_token_ids == [7]
    b = _seq("b", 12)
    s.add_request(b)
    plan = s.schedule()
    assert _ids(plan) == [("a", 1), ("b", 7)]  # a's decode first, b's prompt chunked by the budget
    assert plan.num_batched_tokens == 8 and not plan.scheduled[1].sample
    assert s.update(plan, _run(plan)) == [a]  # a partial chunk yields no token
    assert b.num_computed_tokens == 7
    plan = s.schedule()
    assert _ids(plan) == [("a", 1), ("b", 5)] and plan.scheduled[1].sample


def test_stop_conditions_finish_and_free_blocks():
    s = _sched()
    length = _seq("length", 3, max_tokens=2)
    eos = _seq("eos", 3)
    stop_id = _seq("stop-id", 3, stop_token_ids=[9])
    ignore = _seq("ignore", 3, max_tokens=2, ignore_eos=True)
    for q in (length, eos, stop_id, ignore):
        s.add_request(q)
    plan = s.schedule()
    s.update(plan, RunnerOutput([SampledToken(t) for t in (5, EOS, 9, EOS)]))
    assert eos.status == SequenceStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_id.status == SequenceStatus.FINISHED_STOPPED and stop_id.stop_reason == 9
    assert not length.is_finished and not ignore.is_finished
    plan = s.schedule()
    assert _ids(plan) == [("length", 1), ("ignore", 1)]
    s.update(plan, RunnerOutput([SampledToken(5), SampledToken(EOS)]))  # EOS ignored: length ends it
    assert length.finish_reason == "length" and ignore.finish_reason == "length"
    assert not s.has_unfinished() and s.kv.stats().num_used == 0


def test_sequence_finished_while_its_step_ran_is_left_alone():
    s = _sched()
    a = _seq("a", 3)
    s.add_request(a)
    plan = s.schedule()
    s.finish_request(a, SequenceStatus.FINISHED_ABORTED)
    assert s.update(plan, _run(plan)) == [] and a.output_token_ids == []
    assert s.kv.stats().num_used == 0


def test_full_cache_preempts_the_newest_and_recomputes_it_later():
    s = _sched(num_blocks=3, block_size=4)
    old, new = _seq("old", 4, max_tokens=8), _seq("new", 4, max_tokens=8)
    s.add_request(old)
    s.add_request(new)
    plan = s.schedule()
    assert _ids(plan) == [("old", 4), ("new", 4)]
    s.update(plan, _run(plan))
    # Both decodes need a second block; only one is free: the newest is preempted, the oldest runs.
    plan = s.schedule()
    assert _ids(plan) == [("old", 1)] and plan.preempted == [new]
    assert new.status == SequenceStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting == [new] and s.stats.num_preemptions == 1
    s.update(plan, _run(plan))
    while old in s.running:  # old finishes; then new is recomputed (prompt + its first token)
        plan = s.schedule()
        s.update(plan, _run(plan))
    plan = s.schedule()
    assert _ids(plan) == [("new", 5)]


def test_max_num_seqs_caps_admission():
    s = _sched(max_num_seqs=2)
    for i in range(4):
        s.add_request(_seq(f"r{i}", 3))
    plan = s.schedule()
    assert [sid for sid, _ in _ids(plan)] == ["r0", "r1"] and len(s.waiting) == 2


def test_priority_policy_admits_lower_value_first():
    s = _sched(policy="priority", max_num_seqs=1)
    low = _seq("low", 3, arrival=0.0)
    low.priority = 5
    high = _seq("high", 3, arrival=1.0)
    s.add_request(low)
    s.add_request(high)
    assert _ids(s.schedule()) == [("high", 3)]


@pytest.mark.parametrize("resident_first", [True, False])
def test_max_loras_limits_distinct_adapters_per_step(resident_first):
    s = _sched(max_loras=2, resident_first=resident_first)
    for sid, lora in (("a", "x"), ("b", "y"), ("c", "z"), ("d", "x"), ("e", None)):
        s.add_request(_seq(sid, 3, lora=lora))
    # the adapters of the free slots; resident-first admission also names up to max_loras more to load ahead
    assert s.adapters_wanted() == (["x", "y", "z"] if resident_first else ["x", "y"])
    plan = s.schedule()
    # z would be a third adapter: passed over; d shares x and e uses none, so both still run.
    assert [sid for sid, _ in _ids(plan)] == ["a", "b", "d", "e"]
    assert s.running_adapters() == {"x", "y"}
    assert s.adapters_wanted() == (["z"] if resident_first else [])
    assert s.waiting[0].seq_id == "c" and s.waiting[0].num_lora_skips == 1


def test_starved_adapter_blocks_admission_behind_it():
    s = _sched(max_loras=1, lora_starvation_steps=2)
    s.add_request(_seq("x1", 3, max_tokens=50, lora="x"))
    plan = s.schedule()
    s.update(plan, _run(plan))
    s.add_request(_seq("y1", 3, lora="y"))
    s.add_request(_seq("x2", 3, lora="x"))
    plan = s.schedule()  # y1 skipped once; x2 (same adapter as the running one) still admitted
    assert [sid for sid, _ in _ids(plan)] == ["x1", "x2"]
    s.update(plan, _run(plan))
    s.add_request(_seq("x3", 3, lora="x"))
    plan = s.schedule()  # y1 skipped a second time: it now blocks x3 behind it
    assert [sid for sid, _ in _ids(plan)] == ["x1", "x2"]
    assert [q.seq_id for q in s.waiting] == ["y1", "x3"]


def test_adapter_not_resident_or_not_resolved_is_passed_over():
    resident: set[str] = set()
    s = _sched(is_resident=resident.__contains__)
    s.add_request(_seq("cold", 3, lora="x"))
    unresolved = _seq("unresolved", 3, lora="y")
    unresolved.lora_key = None  # its digest is still being computed by a background load
    s.add_request(unresolved)
    s.add_request(_seq("base", 3))
    assert s.adapters_wanted() == ["x"]  # the engine makes these resident before scheduling
    plan = s.schedule()
    assert _ids(plan) == [("base", 3)]
    s.update(plan, _run(plan))
    resident.add("x")
    plan = s.schedule()
    assert _ids(plan) == [("base", 1), ("cold", 3)]
    s.update(plan, _run(plan))
    unresolved.lora_key = "y"
    resident.add("y")
    assert _ids(s.schedule()) == [("base", 1), ("cold", 1), ("unresolved", 3)]


def test_prefix_cache_hit_skips_cached_tokens_and_separates_adapters():
    s = _sched(block_size=4)
    first = _seq("first", 9, max_tokens=1)
    s.add_request(first)
    plan = s.schedule()
    s.update(plan, _run(plan))
    assert first.is_finished
    same = Sequence(
        "same", list(first.prompt_token_ids), SamplingParams(max_tokens=1), 0.0, max_total_tokens=99
    )
    other = Sequence(
        "other",
        list(first.prompt_token_ids),
        SamplingParams(max_tokens=1),
        0.0,
        lora_key="x",
        max_total_tokens=99,
    )
    s.add_request(same)
    s.add_request(other)
    plan = s.schedule()
    assert _ids(plan) == [("same", 1), ("other", 9)]  # 8 tokens (2 blocks) cached, never across adapters
    assert same.num_cached_tokens == 8 and other.num_cached_tokens == 0
