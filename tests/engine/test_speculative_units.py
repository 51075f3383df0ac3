"""Speculative decoding's parts alone: prompt lookup, adaptive k, option parsing, the scheduler's
budget for speculative rows, and KV rollback of rejected blocks (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.output import RunnerOutput, SampledToken
from engine.sequence import Sequence
from engine.spec.adaptive import SpecState
from engine.spec.config import SpeculativeConfig
from engine.spec.cost import StepCostModel
from engine.spec.ngram import NgramProposer, lookup


def _lookup(tokens, k=4, min_n=1, max_n=3):
    return lookup(np.asarray(tokens, dtype=np.int64), k, min_n, max_n)


def test_lookup_takes_the_longest_suffix_match_then_the_earliest_occurrence():
    # suffix [1, 2] occurs at 0 (followed by 3 4 5) and at 5 (followed by 9); trigram [7, 1, 2] at 4
    assert _lookup([1, 2, 3, 4, 7, 1, 2, 9, 7, 1, 2]) == [9, 7, 1, 2]
    assert _lookup([1, 2, 3, 4, 5, 8, 1, 2], k=2) == [3, 4]
    assert _lookup([5, 6, 7, 8]) == []  # no earlier occurrence of any suffix
    assert _lookup([5, 6, 5], min_n=2) == []  # unigram matches not allowed
    assert _lookup([5, 6, 5]) == [6, 5]  # the proposal may run into the suffix itself
    assert _lookup([3]) == []


def test_ngram_proposer_respects_each_k():
    seqs = [
        Sequence("a", [1, 2, 3, 1, 2], SamplingParams(), 0.0),
        Sequence("b", [4, 4], SamplingParams(), 0.0),
    ]
    assert NgramProposer(1, 3).propose(seqs, [1, 3]) == [[3], [4]]
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(3, 2)


def test_adaptive_k_follows_acceptance_and_the_break_even_probability():
    st = SpecState(k_max=4, max_backoff=8)
    assert st.alpha == pytest.approx(0.7)  # the prior
    assert st.next_k(theta=0.2) == 4  # 0.7^4 = 0.24 > 0.2
    assert st.next_k(theta=0.5) == 1  # 0.7^2 = 0.49 < 0.5
    for _ in range(5):
        st.record(4, 4)  # everything accepted: alpha -> 1
    assert st.alpha > 0.9 and st.next_k(theta=0.6) == 4
    for _ in range(15):
        st.record(4, 0)  # nothing accepted: alpha drops
    assert st.alpha < 0.3
    assert st.next_k(theta=0.1) >= 1  # cheap rows: still worth a try
    assert st.next_k(theta=0.5) == 0  # expensive rows: pause 2 more steps, then probe with k = 1
    assert [st.next_k(0.5) for _ in range(3)] == [0, 0, 1]
    st.record(1, 0)  # failed probe: this step decides 0 again and pauses 4 more (doubled)
    assert [st.next_k(0.5) for _ in range(6)] == [0] * 5 + [1]
    st.record(1, 0)  # then 8, the cap
    assert [st.next_k(0.5) for _ in range(10)] == [0] * 9 + [1]
    st.record(1, 0)
    assert st.next_k(0.5) == 0 and st.paused == 8
    assert (st.proposed, st.verifications) == (83, 23)


def test_break_even_probability_is_fitted_from_step_times():
    cost = StepCostModel(prior=0.3)
    assert cost.theta() == 0.3  # no data yet
    for _ in range(10):
        cost.observe(8, 0.006, 8)  # R never varies: b cannot be fitted
    assert cost.theta() == 0.3
    for rows in (8, 16, 32, 8, 16, 32, 8, 16, 32):
        cost.observe(rows, 0.002 + 0.0005 * rows, 8)  # a = 2 ms, b = 0.5 ms per row
    assert cost.row_seconds() == pytest.approx(0.0005, rel=1e-6)
    # 8 tokens per step in about 2 + 0.5 * mean(R) ms: theta = b * 8 / t
    mean_t = cost.st / cost.w
    assert cost.theta() == pytest.approx(0.0005 * 8 / mean_t, rel=1e-6)
    free = StepCostModel()
    for rows in (1, 5, 9) * 5:
        free.observe(rows, 0.003, 1)  # extra rows cost nothing (memory-bound decode)
    assert free.theta() == free.min_theta


def test_options_are_validated():
    assert SpeculativeConfig.parse(None, 4) is None
    assert SpeculativeConfig.parse("ngram", 3) == SpeculativeConfig("ngram", 3)
    assert SpeculativeConfig.parse("draft:/m", 2).draft_path == "/m"
    for spec, k, msg in (
        ("medusa", 4, "speculative must be"),
        ("draft:", 4, "speculative must be"),
        ("ngram", 0, "num_speculative_tokens"),
        ("ngram", 17, "num_speculative_tokens"),
        ("ngram", True, "num_speculative_tokens"),
    ):
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model=".", speculative=spec, num_speculative_tokens=k).check_choices()


def _sched(budget: int, num_blocks: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, policy="fcfs", max_loras=8)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), (2,))


def _decoding(s: Scheduler, sid: str, prompt_len: int = 5, max_tokens: int = 20) -> Sequence:
    seq = Sequence(sid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)
    seq.max_total_tokens = prompt_len + max_tokens
    s.add_request(seq)
    return seq


def test_budget_counts_speculative_rows_after_one_row_per_running_request():
    s = _sched(budget=8)
    a, b, c = (_decoding(s, x) for x in "abc")
    plan = s.schedule()
    s.update(plan, RunnerOutput([SampledToken(7) for _ in plan.scheduled]))
    for seq in (a, b, c):
        seq.spec_token_ids = [1, 2, 3, 4]
    plan = s.schedule()
    rows = [(it.seq.seq_id, it.num_tokens, len(it.spec_token_ids)) for it in plan.scheduled]
    # 8 rows: a takes 1 + 4 proposals, b is left 8 - 5 - 1 (kept for c) = 2 rows, c its one decode
    assert rows == [("a", 5, 4), ("b", 2, 1), ("c", 1, 0)]
    assert plan.num_batched_tokens == 8
    assert all(not seq.spec_token_ids for seq in (a, b, c))  # proposals are consumed


def test_proposals_stop_at_the_length_limit_and_rejected_blocks_are_released():
    s = _sched(budget=64)
    a = _decoding(s, "a", prompt_len=4, max_tokens=10)
    plan = s.schedule()
    s.update(plan, RunnerOutput([SampledToken(7)]))  # 5 tokens, 4 computed
    free_before = s.kv.pool.num_free
    a.spec_token_ids = list(range(20, 40))
    plan = s.schedule()
    item = plan.scheduled[0]
    assert len(item.spec_token_ids) == 8  # 9 tokens may still come: 8 proposals + the target's own
    assert s.kv.pool.num_free == free_before - 3  # rows 4..12 need blocks 1..3 (block 0 was held)
    # the target accepts the first proposal only: tokens 5 (=20) and 6 (the target's), 6 computed
    tokens = [SampledToken(20), SampledToken(99)]
    s.update(plan, RunnerOutput([tokens[0]], [tokens]))
    assert a.output_token_ids == [7, 20, 99]
    assert a.num_computed_tokens == 6 and a.num_tokens == 7
    assert len(s.kv.block_ids(a)) == 2  # the two blocks holding only rejected rows went back
    assert s.kv.pool.num_free == free_before - 1
