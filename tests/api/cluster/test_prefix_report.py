"""A replica's report of its prefix cache, without Ray: the engine's events mirrored (`HeldBlocks`), the
Bloom summary the router reads, and the router's prediction against what the engine finds."""

from __future__ import annotations

import os

from api.cluster.prefix_report import BITS_PER_BLOCK, BlockSummary, HeldBlocks
from api.cluster.router_score import PrefixIndex, prompt_block_hashes
from api.engine_protocol import KVEventsMsg
from engine.kv_cache import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def _run(kv: KVCacheManager, rid: str, tokens: list[int], digest: str | None) -> None:
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=1), 0.0, lora_key=digest, max_total_tokens=99)
    assert kv.allocate_slots(seq, len(tokens))
    kv.free(seq)


def _report(kv: KVCacheManager, held: HeldBlocks) -> BlockSummary:
    events = kv.pool.take_events()
    assert events is not None
    held.apply(KVEventsMsg(events.reset, events.stored, events.removed))
    return held.summary()


def _engine_hit_blocks(kv: KVCacheManager, tokens: list[int], digest: str | None) -> int:
    seq = Sequence("probe", tokens, SamplingParams(max_tokens=1), 0.0, lora_key=digest, max_total_tokens=99)
    return len(kv.find_cached_prefix(seq)[0])


def test_the_router_predicts_what_the_engine_holds_after_evictions() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.pool.enable_events()
    held = HeldBlocks(max_blocks=8)
    index = PrefixIndex(ttl_s=0.0)  # only the replica's report counts
    system = list(range(100, 116))  # 4 blocks
    _run(kv, "a", [*system, 1, 2, 3, 4, 5], "d1")
    summary = _report(kv, held)
    probe = [*system, 9, 9, 9, 9, 9]
    hashes = prompt_block_hashes(probe, BS, "d1")
    assert index.cached_blocks("r", hashes, summary) == _engine_hit_blocks(kv, probe, "d1") == 4
    for i in range(3):  # other prompts evict the system prompt's blocks
        _run(kv, f"x{i}", [1000 * (i + 1) + t for t in range(13)], None)
    summary = _report(kv, held)
    assert _engine_hit_blocks(kv, probe, "d1") == 0
    assert index.cached_blocks("r", hashes, summary) == 0, "a predicted hit on evicted blocks"
    assert len(held) == kv.pool.num_cached <= 8


def test_a_new_digest_predicts_no_hit_on_the_old_blocks() -> None:
    """Delete + re-register a name with other weights: same prompt, new digest, no predicted hit."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    kv.pool.enable_events()
    held = HeldBlocks(max_blocks=16)
    tokens = list(range(21))
    _run(kv, "old", tokens, "old-digest")
    summary = _report(kv, held)
    index = PrefixIndex(ttl_s=0.0)
    assert index.cached_blocks("r", prompt_block_hashes(tokens, BS, "old-digest"), summary) == 5
    assert index.cached_blocks("r", prompt_block_hashes(tokens, BS, "new-digest"), summary) == 0
    assert _engine_hit_blocks(kv, tokens, "new-digest") == 0


def test_summary_has_no_false_negatives_and_few_false_positives() -> None:
    hashes = [os.urandom(32) for _ in range(2000)]
    held = HeldBlocks(max_blocks=2000)
    held.apply(KVEventsMsg(True, hashes, []))
    summary = BlockSummary.from_stats(held.summary().as_stats())
    assert summary is not None and summary.blocks == 2000
    assert all(summary.contains(h) for h in hashes)
    assert sum(summary.contains(os.urandom(32)) for _ in range(4000)) < 10  # ~0.05% expected
    assert len(summary.bits) * 8 == summary.num_bits <= 2000 * BITS_PER_BLOCK + 64
    held.apply(KVEventsMsg(False, [], hashes[:1000]))  # evicted: they leave the filter too
    after = held.summary()
    assert sum(after.contains(h) for h in hashes[:1000]) < 10
    assert all(after.contains(h) for h in hashes[1000:])
    assert BlockSummary.build(hashes[1000:]).contains(hashes[1500])


def test_recently_routed_blocks_count_until_the_report_covers_them() -> None:
    """A routed block counts until a report arrives ttl_s after it was routed, however late that is."""
    index = PrefixIndex(ttl_s=5.0)
    hashes = prompt_block_hashes(list(range(12)), BS, None)
    index.record("r", hashes, now=100.0)
    assert index.cached_blocks("r", hashes, None) == 3
    index.reported("r", now=101.0)  # too soon after the routing to include the blocks
    assert index.cached_blocks("r", hashes, None) == 3
    # no report for a long time (a loaded replica): still predicted, the index is not a clock
    assert index.cached_blocks("r", hashes, None) == 3 and index.size("r") == 3
    index.reported("r", now=130.0)  # a late report: it covers them, so only the report counts now
    assert index.cached_blocks("r", hashes, None) == 0 and index.size("r") == 0
    assert index.cached_blocks("r", hashes, BlockSummary.build(hashes[:2])) == 2
    index.record("r", hashes[:1], now=131.0)  # routed again after that report: counted again
    assert index.cached_blocks("r", hashes, None) == 1
    assert index.cached_blocks("other", hashes, None) == 0
