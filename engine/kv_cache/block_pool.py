"""Fixed-size KV blocks with reference counts and a content-addressed prefix cache.

Block life cycle::

    free (uncached) --allocate--> in use (ref>=1) --cache_full_block--> in use + cached
    in use --release, ref hits 0--> free; still cached, so a later request with the same
                                    prefix can `touch` it back into use
    free + cached --allocate (LRU front)--> evicted from the cache and reused

Free blocks sit in one LRU queue (oldest release first). `allocate` takes from the front, evicting the
cache entry of a block it reuses; `release` appends to the back, so the most recently used prefixes live
longest. A request releases its blocks tail-first, so a prefix's last blocks go before its first ones.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.kv_cache.cache_events import CacheEvents, CacheJournal


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: Sequence[int], adapter_key: str | None) -> bytes:
    """Key of a full block: sha256(parent hash, the block's token ids, adapter digest or none).

    Chaining the parent makes a block's key identify the whole prefix that ends with it; the adapter key
    keeps K/V computed under different adapters (or the base model) apart.
    """
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(b"|" + (adapter_key or "").encode() + b"|")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


def block_key(adapter_digest: str | None, num_prompt_tokens: int, long_prompt_from: int | None) -> str | None:
    """The adapter key a request's blocks are hashed with: its adapter's content digest (None: the base
    model), set apart for prompts longer than `long_prompt_from` (LongRoPE rotates their K/V with the long
    factors). The engine and a router predicting its cache both use this."""
    if long_prompt_from is not None and num_prompt_tokens > long_prompt_from:
        return f"{adapter_digest or ''}#long-rope"
    return adapter_digest


class BlockPool:
    """Owns `num_blocks` KV blocks: allocation, ref counts, and the hash -> block prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.journal: CacheJournal | None = None  # set by `enable_events`

    def enable_events(self) -> None:
        """Record what enters and leaves the prefix cache, for `take_events` (at most twice the pool's
        blocks are kept between takes)."""
        if self.journal is None:
            self.journal = CacheJournal(bound=2 * self.num_blocks)

    def take_events(self) -> CacheEvents | None:
        """The prefix cache's changes since the last take (None unless `enable_events` was called)."""
        return self.journal.take(self._cached.keys) if self.journal is not None else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (including cached ones that may be evicted)."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self.blocks[b].block_hash is not None)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        """The cached block holding this prefix, or None."""
        if not self.enable_caching:
            return None
        idx = self._cached.get(block_hash)
        return None if idx is None else self.blocks[idx]

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` free blocks (LRU first), evicting their cache entries. Caller checks `num_free`."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            idx, _ = self._free.popitem(last=False)
            block = self.blocks[idx]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == idx:
                    del self._cached[block.block_hash]
                    if self.journal is not None:
                        self.journal.removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the back of the free queue."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released too often"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its prefix hash (first writer wins for duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash not in self._cached:
            self._cached[block_hash] = block.block_id
            if self.journal is not None:
                self.journal.stored(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        if self.journal is not None:
            self.journal.cleared()
        return True
