"""Per-request block tables on top of the `BlockPool`, with prefix-cache lookup.

Invariants:
- `block_table(req)[i]` holds the K/V of the request's tokens `[i*block_size, (i+1)*block_size)`.
- A block becomes cached once every one of its tokens is known and scheduled for computation; its key
  chains the previous block's key, so a hit on block i implies hits on blocks 0..i-1.
- Freeing a request (finish, abort or preemption) releases every reference it holds; when no request is
  left, every block is free (some still cached).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, KVBlock, block_key, hash_block
from engine.sequence import Sequence
from kernels.intmath import cdiv


@dataclass(slots=True)
class KVCacheStats:
    num_blocks: int
    num_used: int
    num_cached_free: int
    num_free: int
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int


class KVCacheManager:
    """Allocates blocks to requests and finds their cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        # with LongRoPE, K/V of a prompt longer than this is rotated with the long
        # factors (engine/model/rope.py), so such requests' blocks are keyed apart from shorter ones'
        self.long_prompt_from: int | None = None
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already in the cache
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found cached

    def block_ids(self, req: Sequence) -> list[int]:
        return [b.block_id for b in self._tables.get(req.seq_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, req: Sequence, upto_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks covering its first `upto_tokens` tokens (memoized)."""
        hashes = self._hashes.setdefault(req.seq_id, [])
        bs = self.block_size
        tokens = req.all_token_ids
        key = block_key(req.lora_key, req.num_prompt_tokens, self.long_prompt_from)
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], key))
        return hashes

    def find_cached_prefix(self, req: Sequence) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute (the model must produce logits for the last one),
        so a hit never covers all of `req.num_tokens`. Returns (blocks, number of cached tokens).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in self._block_hashes(req, max_blocks * self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, req: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_hit_tokens

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_blocks

    def allocate_slots(
        self, req: Sequence, num_new_tokens: int, cached_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed (and cached) ones.

        `cached_blocks` (from `find_cached_prefix`, only for a request with no blocks yet) are taken by
        reference instead of being recomputed. Returns False, changing nothing, if the pool lacks blocks.
        Full blocks among the tokens scheduled this step are registered in the prefix cache.
        """
        cached_blocks = cached_blocks or []
        table = self._tables.setdefault(req.seq_id, [])
        assert not cached_blocks or not table, "cached prefix only for a request without blocks"
        num_cached = len(cached_blocks) * self.block_size
        total_tokens = req.num_computed_tokens + num_cached + num_new_tokens
        need = self.blocks_needed(total_tokens) - len(table) - len(cached_blocks)
        reclaim = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free - reclaim:
            if not table:
                del self._tables[req.seq_id]
            return False
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if need > 0:
            table.extend(self.pool.allocate(need))
        if self.enable_prefix_caching:
            full = min(total_tokens, req.num_tokens) // self.block_size
            hashes = self._block_hashes(req, full * self.block_size)
            start = self._num_registered.get(req.seq_id, 0)
            for i in range(start, full):
                self.pool.cache_block(table[i], hashes[i])
            self._num_registered[req.seq_id] = max(start, full)
        return True

    def import_blocks(self, req: Sequence, num_tokens: int) -> tuple[list[int], int] | None:
        """A block table for a request whose first `num_tokens` tokens' K/V come from another engine
        (engine/kv_transfer): its cached prefix here (when its adapter digest is known) plus fresh blocks.
        Returns (block ids, how many leading ones were cached), or None, holding nothing, without room.
        The blocks are registered in the prefix cache when the request is admitted (`allocate_slots`)."""
        assert req.seq_id not in self._tables, "import into a request that holds blocks"
        hits: list[KVBlock] = []
        if req.lora_request is None or req.lora_key is not None:
            hits = self.find_cached_prefix(req)[0][: num_tokens // self.block_size]
        need = self.blocks_needed(num_tokens) - len(hits)
        reclaim = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free - reclaim:
            return None
        self.pool.touch(hits)
        table = self._tables[req.seq_id] = [*hits, *self.pool.allocate(need)]
        return [b.block_id for b in table], len(hits)

    def free(self, req: Sequence) -> None:
        """Release all of the request's blocks, tail first (so its prefix's head stays cached longest)."""
        table = self._tables.pop(req.seq_id, None)
        self._num_registered.pop(req.seq_id, None)
        if table:
            self.pool.release(reversed(table))
        if req.is_finished:
            self._hashes.pop(req.seq_id, None)

    def trim(self, req: Sequence, num_tokens: int) -> int:
        """Release the request's blocks past those holding its first `num_tokens` tokens (speculative
        rows that were rejected); returns how many blocks were freed. Such blocks were never cached:
        only blocks full of known tokens are."""
        table = self._tables.get(req.seq_id)
        if not table:
            return 0
        keep = self.blocks_needed(num_tokens)
        extra = table[keep:]
        if not extra:
            return 0
        assert keep >= self._num_registered.get(req.seq_id, 0), "a trimmed block is in the prefix cache"
        del table[keep:]
        self.pool.release(reversed(extra))
        return len(extra)

    def num_requests(self) -> int:
        return len(self._tables)

    def stats(self) -> KVCacheStats:
        free = self.pool.num_free
        total = self.pool.num_blocks
        return KVCacheStats(
            num_blocks=total,
            num_used=total - free,
            num_cached_free=self.pool.num_cached_free,
            num_free=free,
            usage=(total - free) / total,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
        )
