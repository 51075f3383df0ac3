"""Paged KV cache: a ref-counted block pool with hash-chained prefix caching, and per-request tables."""

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVBlock", "KVCacheManager"]
