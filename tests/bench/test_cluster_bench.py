"""The cluster benchmark's parts that need no Ray cluster (the benchmark itself runs by hand): the trace,
the routers by name, and the report."""

from __future__ import annotations

import itertools
from collections import Counter
from types import SimpleNamespace

import pytest

from bench.cluster.replay import Counters, Replayed, Sent
from bench.cluster.report import markdown, percentile, run_metrics, spread
from bench.cluster.routers import ROUTERS, plan
from bench.cluster.workload import WorkloadSpec, attainable_hit_rate, build_trace, popularity

SPEC = WorkloadSpec(steady_s=20, rate=10, chats=6, turns=3, burst_s=5, burst_rate=20, seed=3)


def test_popularity_is_a_decreasing_distribution() -> None:
    p = popularity(16, 1.0)
    assert abs(sum(p) - 1.0) < 1e-9 and all(a > b for a, b in itertools.pairwise(p))
    assert abs(p[0] / p[3] - 4.0) < 1e-9


def test_the_trace_is_identical_for_a_seed_and_holds_every_kind() -> None:
    trace = build_trace(SPEC)
    assert trace == build_trace(SPEC) and trace != build_trace(WorkloadSpec(seed=4))
    assert [a.at for a in trace] == sorted(a.at for a in trace)
    kinds = Counter(a.kind for a in trace)
    assert set(kinds) == {"adapter", "chat", "hot"}
    assert kinds["chat"] == SPEC.chats * SPEC.turns
    assert all(a.adapter is None for a in trace if a.kind == "chat")
    # the steady phase's adapters follow the power law: adapter 0 is the most used
    steady = Counter(a.adapter for a in trace if a.kind == "adapter" and a.phase == "steady")
    assert steady.most_common(1)[0][0] == 0
    # the burst sends most of its requests to the hot adapter
    burst = [a for a in trace if a.phase == "burst" and a.kind != "chat"]
    assert sum(a.adapter == SPEC.hot for a in burst) > 0.6 * len(burst)
    assert all(len(a.prompt) <= SPEC.longest_prompt() for a in trace)


def test_a_chat_turn_extends_the_one_before_and_prompts_share_system_prompts() -> None:
    trace = build_trace(SPEC)
    chats = [a for a in trace if a.kind == "chat"]
    firsts = [a for a in chats if len(a.prompt) <= SPEC.system_tokens + SPEC.user_tokens[1]]
    for first in firsts:
        later = [a for a in chats if a.at > first.at and a.prompt[: len(first.prompt)] == first.prompt]
        assert len(later) == SPEC.turns - 1
    heads = {a.prompt[: SPEC.system_tokens] for a in trace}
    assert len(heads) <= SPEC.system_prompts


def test_attainable_hit_rate_counts_repeated_block_prefixes_per_adapter() -> None:
    from bench.cluster.workload import Arrival

    p = tuple(range(3, 3 + 32))  # two blocks of 16
    same = [Arrival(0, "steady", "adapter", 1, 0, p), Arrival(1, "steady", "adapter", 1, 0, p)]
    assert attainable_hit_rate(same, 16) == 0.5  # the second prompt hits both blocks
    other = [Arrival(0, "steady", "adapter", 1, 0, p), Arrival(1, "steady", "adapter", 2, 0, p)]
    assert attainable_hit_rate(other, 16) == 0.0  # another adapter: another cache key


def test_a_bounded_cache_evicts_the_least_recently_used_blocks() -> None:
    from bench.cluster.workload import Arrival

    a, b = tuple(range(3, 19)), tuple(range(40, 56))  # one block each
    trace = [Arrival(t, "steady", "adapter", 1, 0, p) for t, p in enumerate((a, b, a, b))]
    assert attainable_hit_rate(trace, 16) == 0.5  # unbounded: the last two hit
    assert attainable_hit_rate(trace, 16, cache_blocks=2) == 0.5  # both fit
    assert attainable_hit_rate(trace, 16, cache_blocks=1) == 0.0  # each evicts the other
    lru = [Arrival(t, "steady", "adapter", 1, 0, p) for t, p in enumerate((a, b, b, a))]
    assert attainable_hit_rate(lru, 16, cache_blocks=1) == 0.25  # only b's repeat, right after itself


def test_routers_are_known_by_name() -> None:
    assert ROUTERS == ("pow2", "multiplex", "ray-prefix", "affinity")
    assert plan("pow2").model_id is False and plan("multiplex").model_id is True
    assert plan("affinity").cluster_router == "affinity" and plan("affinity").router_class is None
    with pytest.raises(ValueError, match="unknown router"):
        plan("random")


def test_rays_prefix_router_reads_the_engine_request() -> None:
    """What the adapter subclass gives Ray's router as the prompt's text: its token ids, one character
    each (the subclass itself is built, importing Ray, by the benchmark)."""
    from api.engine_protocol import AddRequest, encode
    from bench.cluster.routers import _prompt_text
    from engine import SamplingParams

    req = AddRequest(request_id="r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=1))
    assert _prompt_text(SimpleNamespace(args=[encode(req)])) == "".join(chr(0x100 + t) for t in (5, 6, 7))
    assert _prompt_text(SimpleNamespace(args=[])) == "?" and _prompt_text(SimpleNamespace(args=[b"x"])) == "?"


def test_report_gives_median_and_range_and_checks_the_goals() -> None:
    trace = build_trace(SPEC)

    def replayed(ttft: float, hits: int) -> Replayed:
        sent = [Sent(a.kind, a.phase, a.at, a.at + ttft, a.at + ttft + 1, 16, True) for a in trace]
        return Replayed(sent, Counters(1000, hits, 10, 20), [(1.0, 5, 2), (21.0, 40, 9)], 2)

    runs = [
        run_metrics(name, i, replayed(ttft, hits), trace, SPEC.steady_s)
        for i in range(3)
        for name, ttft, hits in (("multiplex", 2.0 + i, 500), ("affinity", 0.5 + i / 10, 800))
    ]
    a = runs[1]
    assert a.prefix_hit_rate == 0.8 and a.loads_per_1k == pytest.approx(1000 * 20 / len(trace))
    assert a.ttft_p99 == pytest.approx(0.5) and a.queue_at_burst == 5 and a.peak_queue == 40
    text = markdown(runs, len(trace) / 25, 0.9)
    assert "| affinity | 80.0% (80.0%–80.0%) |" in text and "0.60 (0.50–0.70)" in text
    assert "TTFT p99 0.60 s vs best other (multiplex) 3.00 s: met" in text
    assert "Attainable prefix-hit rate" in text


def test_percentile_and_spread() -> None:
    assert percentile(list(range(1, 101)), 0.99) == 99 and percentile([], 0.5) == 0.0
    assert spread([3.0, 1.0, 2.0], "{:.1f}") == "2.0 (1.0–3.0)" and spread([1.0], "{:.1f}") == "1.0"
