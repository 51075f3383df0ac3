"""The prefix cache's stored/evicted events (`BlockPool.enable_events`): what a consumer mirrors from
them is exactly what the cache holds, in bounded memory."""

from __future__ import annotations

from engine.kv_cache import KVCacheManager
from engine.kv_cache.block_pool import BlockPool
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def _seq(rid: str, tokens: list[int], key: str | None = None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=1), 0.0, lora_key=key, max_total_tokens=99)


def _mirror(held: set[bytes], pool: BlockPool) -> set[bytes]:
    events = pool.take_events()
    assert events is not None
    if events.reset:
        held = set()
    return (held | set(events.stored)) - set(events.removed)


def _cached(pool: BlockPool) -> set[bytes]:
    return {b.block_hash for b in pool.blocks if b.block_hash is not None and pool.lookup(b.block_hash) is b}


def test_events_mirror_the_cache_through_stores_and_evictions() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    kv.pool.enable_events()
    held = _mirror(set(), kv.pool)  # the first take is a snapshot: empty
    assert held == set()
    for i in range(5):  # 3 full blocks each: later requests evict earlier requests' cached blocks
        seq = _seq(f"r{i}", [i * 100 + t for t in range(13)], key="d" if i % 2 else None)
        assert kv.allocate_slots(seq, 13)
        held = _mirror(held, kv.pool)
        assert held == _cached(kv.pool)
        kv.free(seq)
    assert kv.pool.num_evictions > 0
    assert held == _cached(kv.pool) and len(held) <= kv.pool.num_blocks


def test_the_journal_is_bounded_and_falls_back_to_a_snapshot() -> None:
    pool = BlockPool(num_blocks=2)
    pool.enable_events()
    pool.take_events()
    for i in range(10):  # far more changes than 2 * num_blocks, with no take in between
        (block,) = pool.allocate(1)
        pool.cache_block(block, bytes([i]) * 32)
        pool.release([block])
    assert pool.journal is not None and len(pool.journal._stored) + len(pool.journal._removed) <= 4
    events = pool.take_events()
    assert events is not None and events.reset and set(events.stored) == _cached(pool)
    assert pool.reset_prefix_cache()
    cleared = pool.take_events()
    assert cleared is not None and cleared.reset and cleared.stored == []


def test_no_events_unless_enabled() -> None:
    pool = BlockPool(num_blocks=2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"x" * 32)
    assert pool.take_events() is None and pool.journal is None
