"""Scheduler behaviour through the engine: budgets, policies, aborts and accounting."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams


def _engine(checkpoint, **kw) -> LLMEngine:
    return LLMEngine.from_args(str(checkpoint("llama")), device="cpu", dtype="float32", block_size=4, **kw)


def _params(n_tokens: int = 5, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_decodes_first_and_budget_respected(checkpoint):
    eng = _engine(checkpoint, max_num_batched_tokens=10)
    eng.add_request("a", list(range(3, 9)), _params())
    plan = eng.scheduler.schedule()
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [("a", 6)]
    eng.scheduler.update(plan, eng.runner.run(plan))
    eng.add_request("b", list(range(3, 40)), _params())
    plan = eng.scheduler.schedule()
    # a's decode (1 token) goes first, b gets the rest of the budget as a prefill chunk
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [("a", 1), ("b", 9)]
    assert plan.num_batched_tokens == 10 and not plan.scheduled[1].sample
    eng.scheduler.update(plan, eng.runner.run(plan))
    while eng.has_unfinished_requests():
        eng.step()
        assert eng.get_stats().last_step_tokens <= 10
    assert eng.get_stats().kv_blocks_used == 0


def test_max_num_seqs_caps_running(checkpoint):
    eng = _engine(checkpoint, max_num_seqs=2)
    for i in range(5):
        eng.add_request(f"r{i}", [5, 6, 7 + i], _params())
    while eng.has_unfinished_requests():
        eng.step()
        assert len(eng.scheduler.running) <= 2


def test_priority_policy_admits_lower_value_first(checkpoint):
    eng = _engine(checkpoint, scheduling_policy="priority", max_num_seqs=1)
    eng.add_request("low", [5, 6, 7], _params(), priority=5)
    eng.add_request("high", [5, 6, 8], _params(), priority=0)
    plan = eng.scheduler.schedule()
    assert plan.scheduled[0].seq.seq_id == "high"


def test_lpm_policy_prefers_longest_cached_prefix(checkpoint):
    eng = _engine(checkpoint, scheduling_policy="lpm", max_num_seqs=1)
    shared = list(range(3, 23))
    eng.add_request("warm", shared + [50], _params(1))
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("cold", list(range(60, 80)), _params(1))
    eng.add_request("hot", shared + [51], _params(1))
    plan = eng.scheduler.schedule()
    assert plan.scheduled[0].seq.seq_id == "hot"
    assert plan.scheduled[0].start == 20 and plan.scheduled[0].num_tokens == 1


def test_abort_frees_everything(checkpoint):
    eng = _engine(checkpoint)
    eng.add_request("a", list(range(3, 30)), _params(50))
    eng.add_request("b", list(range(3, 12)), _params(50, n=3))
    eng.step()
    eng.step()
    assert eng.get_stats().kv_blocks_used > 0
    eng.abort_request(["a", "b"])
    assert not eng.has_unfinished_requests()
    assert eng.get_stats().kv_blocks_used == 0
    assert eng.step() == []


def test_preemption_is_recompute_and_leaks_nothing(checkpoint):
    eng = _engine(checkpoint, num_kv_blocks=10)
    for i in range(4):
        eng.add_request(f"r{i}", list(range(3 + i, 15 + i)), _params(20))
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert eng.get_stats().num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
    assert eng.get_stats().kv_blocks_used == 0


def test_invalid_policy_rejected(checkpoint):
    with pytest.raises(ValueError, match="scheduling_policy"):
        _engine(checkpoint, scheduling_policy="random")
