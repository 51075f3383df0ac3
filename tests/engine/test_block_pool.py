"""Block pool and KV cache manager: ref counts, prefix hits, LRU eviction, adapter isolation."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockPool, KVCacheManager
from engine.kv_cache.block_pool import hash_block
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus


def _req(rid: str, tokens: list[int], lora_key: str | None = None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4), 0.0, lora_key=lora_key, max_total_tokens=999)


def test_allocate_release_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(b.ref_cnt == 1 for b in a)
    pool.touch(a[:1])
    assert a[0].ref_cnt == 2
    pool.release(a)
    assert pool.num_free == 3 and a[0].ref_cnt == 1
    pool.release(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_hash_chains_parent_and_adapter():
    h1 = hash_block(None, [1, 2], None)
    assert hash_block(None, [1, 2], None) == h1
    assert hash_block(None, [1, 2], "digest-a") != h1
    assert hash_block(h1, [3, 4], None) != hash_block(None, [3, 4], None)


def test_cached_free_blocks_are_evicted_lru():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]))
    pool.release([blocks[1], blocks[0], blocks[2]])  # free order: 1, 0, 2
    assert pool.num_cached == 3
    taken = pool.allocate(1)
    assert taken[0] is blocks[1] and pool.lookup(bytes([1])) is None
    assert pool.lookup(bytes([0])) is blocks[0] and pool.num_evictions == 1


def test_manager_prefix_hit_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    assert len(kv.block_ids(a)) == 3
    a.num_computed_tokens = 10
    b = _req("b", list(range(8)) + [99, 98])
    blocks, n = kv.find_cached_prefix(b)
    assert n == 8 and [x.block_id for x in blocks] == kv.block_ids(a)[:2]
    assert kv.allocate_slots(b, 2, blocks)
    assert kv.block_ids(b)[:2] == kv.block_ids(a)[:2] and kv.block_ids(b)[2] != kv.block_ids(a)[2]
    for r in (a, b):
        r.status = SequenceStatus.FINISHED_STOPPED
        kv.free(r)
    st = kv.stats()
    assert st.num_used == 0 and st.num_free == 8 and st.num_cached_free == 2


def test_hit_never_covers_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    same = _req("b", list(range(8)))
    _, n = kv.find_cached_prefix(same)
    assert n == 4  # the last block is recomputed so the model yields logits for the last token


def test_adapter_key_isolates_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots(_req("a", list(range(9)), lora_key="x"), 9)
    assert kv.find_cached_prefix(_req("b", list(range(9)), lora_key="y"))[1] == 0
    assert kv.find_cached_prefix(_req("c", list(range(9))))[1] == 0
    assert kv.find_cached_prefix(_req("d", list(range(9)), lora_key="x"))[1] == 8


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = _req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.stats().num_free == 2 and kv.block_ids(r) == []


def test_cpu_adapter_cache_is_lru_and_keeps_protected():
    from engine.lora.adapter_checkpoint import AdapterCheckpoint
    from engine.lora.cpu_cache import CpuAdapterCache

    def ckpt(d: str) -> AdapterCheckpoint:
        return AdapterCheckpoint(d, 4, 8.0, ("q_proj",), False, 0, None, ())

    cache = CpuAdapterCache(2)
    cache.put(ckpt("a"))
    cache.put(ckpt("b"))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put(ckpt("c"))
    assert cache.digests() == ["a", "c"] and cache.evictions == 1
    cache.put(ckpt("d"), keep={"a"})  # a is protected (in use), so c goes
    assert cache.digests() == ["a", "d"]
