"""The affinity router's score, without Ray: prefix, adapter residency and load terms."""

from __future__ import annotations

import pytest

from api.cluster.router_score import (
    PrefixIndex,
    ReplicaView,
    Residency,
    RouterWeights,
    prompt_block_hashes,
    rank,
    score,
)
from engine.kv_cache import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
W = RouterWeights()


def _views(**kw) -> list[ReplicaView]:
    return [ReplicaView("a", budget_tokens=1000, **kw), ReplicaView("b", budget_tokens=1000, **kw)]


def _best(views, index, tokens, digest=None, weights=W) -> str:
    hashes = prompt_block_hashes(tokens, BS, digest)
    return rank(views, index, weights, hashes, BS, len(tokens), digest)[0][0].replica_id


def test_predicted_hashes_are_the_engines_cache_keys() -> None:
    """What the router predicts is what the engine's prefix cache finds (same chained, digest-keyed hash)."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(13))
    seq = Sequence("r", tokens, SamplingParams(max_tokens=4), 0.0, lora_key="d1", max_total_tokens=99)
    assert kv.allocate_slots(seq, len(tokens))
    hashes = prompt_block_hashes(tokens, BS, "d1")
    assert len(hashes) == 3
    assert all(kv.pool.lookup(h) is not None for h in hashes)
    assert all(kv.pool.lookup(h) is None for h in prompt_block_hashes(tokens, BS, None))


def test_shared_prefix_goes_to_the_replica_holding_it() -> None:
    index = PrefixIndex()
    system = list(range(100, 132))  # 8 blocks of shared system prompt
    index.record("b", prompt_block_hashes(system + [1, 2, 3, 4], BS, None))
    assert _best(_views(), index, system + [9, 9, 9, 9, 9]) == "b"
    assert _best(_views(), index, [7] * 36) == "a"  # no shared prefix: the tie-break, not "b"


def test_adapter_residency_is_preferred() -> None:
    views = [
        ReplicaView("a", device=frozenset(), host=frozenset(), free_slot=False, budget_tokens=1000),
        ReplicaView("b", host=frozenset({"d"}), budget_tokens=1000),
        ReplicaView("c", device=frozenset({"d"}), budget_tokens=1000),
        ReplicaView("e", free_slot=True, budget_tokens=1000),
    ]
    order = [v.replica_id for v, _ in rank(views, PrefixIndex(), W, [], BS, 8, "d")]
    assert order == ["c", "b", "e", "a"]
    assert [views[i].residency("d") for i in range(4)] == [
        Residency.MUST_EVICT,
        Residency.HOST,
        Residency.DEVICE,
        Residency.FREE_SLOT,
    ]


def test_load_spreads_distinct_prompts() -> None:
    """Distinct prompts, each routed to the best replica and counted there, alternate between replicas."""
    views = {v.replica_id: v for v in _views()}
    index = PrefixIndex()
    chosen = []
    for i in range(6):
        tokens = [i * 1000 + j for j in range(40)]
        best = _best(list(views.values()), index, tokens)
        views[best].in_flight_tokens += len(tokens) + 16
        index.record(best, prompt_block_hashes(tokens, BS, None))
        chosen.append(best)
    assert chosen.count("a") == 3 and chosen.count("b") == 3


def test_load_outweighs_a_prefix_on_an_overloaded_replica() -> None:
    index = PrefixIndex()
    tokens = list(range(40))
    index.record("a", prompt_block_hashes(tokens, BS, None))
    views = _views()
    assert _best(views, index, tokens) == "a"
    views[0].in_flight_tokens = 1000  # a full KV cache's worth queued there
    assert _best(views, index, tokens) == "b"


def test_new_digest_predicts_no_hit_on_the_old_blocks() -> None:
    """Delete + re-register a name with other weights: the new digest keys other blocks."""
    index = PrefixIndex()
    tokens = list(range(40))
    index.record("a", prompt_block_hashes(tokens, BS, "old-digest"))
    assert index.cached_blocks("a", prompt_block_hashes(tokens, BS, "old-digest")) == 10
    assert index.cached_blocks("a", prompt_block_hashes(tokens, BS, "new-digest")) == 0
    view = ReplicaView("a", budget_tokens=1000)
    cached = index.cached_blocks("a", prompt_block_hashes(tokens, BS, "new-digest")) * BS
    assert score(view, W, cached, len(tokens), "new-digest") == W.adapter * Residency.FREE_SLOT.value


def test_prefix_index_is_bounded_and_chained() -> None:
    index = PrefixIndex(max_blocks_per_replica=5)
    first = prompt_block_hashes(list(range(40)), BS, None)
    index.record("a", first)
    assert index.size("a") == 5
    assert index.cached_blocks("a", first) == 0  # the leading blocks were forgotten first: no chain
    index.forget("a")
    assert index.size("a") == 0


def test_weights_validate() -> None:
    with pytest.raises(ValueError, match="negative"):
        RouterWeights(load=-1).validate()


def test_new_adapters_spread_over_idle_replicas() -> None:
    """On an idle cluster a new adapter goes to the replica holding fewer adapters, not always the first."""
    views = [
        ReplicaView("a", device=frozenset({"x", "y"}), budget_tokens=1000),
        ReplicaView("b", device=frozenset({"z"}), budget_tokens=1000),
    ]
    assert _best(views, PrefixIndex(), list(range(8)), "new") == "b"


def test_prefix_index_holds_no_more_than_the_replicas_kv_cache() -> None:
    """A replica with 4 KV blocks cannot still cache an old 3-block prefix after a new 3-block prompt."""
    index = PrefixIndex()
    old, new = prompt_block_hashes(list(range(12)), BS, None), prompt_block_hashes([9] * 12, BS, None)
    index.record("a", old, kv_blocks=4)
    index.record("a", new, kv_blocks=4)
    assert index.size("a") == 4
    assert index.cached_blocks("a", new) == 3
    assert index.cached_blocks("a", old) == 0
