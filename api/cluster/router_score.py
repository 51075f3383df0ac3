"""The affinity router's score of one engine replica for one request, as plain code (no Ray).

    score = w_prefix · (predicted cached prefix tokens / prompt tokens)
          + w_adapter · residency
          − w_load · load

* The prefix term predicts what the replica's engine will find in its prefix cache. The prompt's full
  blocks are hashed with the engine's own chained block hash (`engine.kv_cache.block_pool.hash_block`)
  keyed by the adapter's *content digest* (the key the engine itself uses), so a predicted hit is a hit
  the engine has, and a name re-registered with other weights (a new digest) predicts no hit on the old
  blocks. Which blocks a replica holds is remembered by `PrefixIndex`: a bounded LRU, per replica, of the
  block hashes of the requests routed there, no larger than the replica's KV cache (as its engine evicts).
* Residency of the request's adapter on the replica: device-resident > host-cached > a free device slot
  > must evict another adapter (0 for base-model requests: every replica holds the base model).
* Load: the prompt + maximum new tokens of the requests routed to the replica and not yet finished,
  relative to the replica's token budget (its KV cache, in tokens).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from api.cluster.options import RouterWeights
from engine.kv_cache.block_pool import hash_block

__all__ = ["PrefixIndex", "ReplicaView", "Residency", "RouterWeights", "prompt_block_hashes", "rank", "score"]


class Residency(float, enum.Enum):
    """Where the request's adapter is on a replica, as the residency term's value (1 is best)."""

    DEVICE = 1.0  # in the device pool: no load at all
    HOST = 0.6  # cached in host memory: one upload to the device
    FREE_SLOT = 0.3  # not there, but a device slot is free: a load, no eviction
    MUST_EVICT = 0.0  # not there and the pool is full: a load that evicts another adapter


@dataclass(slots=True)
class ReplicaView:
    """What the router knows of one replica: its adapters by tier (content digests, from the replica's
    routing stats), whether its device pool has a free slot, its token budget, and the tokens of the
    requests routed to it that have not finished (kept by the router)."""

    replica_id: str
    device: frozenset[str] = frozenset()
    host: frozenset[str] = frozenset()
    free_slot: bool = True
    budget_tokens: int = 1
    in_flight_tokens: int = 0

    def residency(self, digest: str) -> Residency:
        """The residency of adapter `digest` on this replica."""
        if digest in self.device:
            return Residency.DEVICE
        if digest in self.host:
            return Residency.HOST
        return Residency.FREE_SLOT if self.free_slot else Residency.MUST_EVICT

    def load(self) -> float:
        """In-flight tokens over the replica's budget (1.0: a full KV cache's worth)."""
        return self.in_flight_tokens / max(1, self.budget_tokens)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, digest: str | None) -> list[bytes]:
    """The engine's hashes of the prompt's full blocks (chained, keyed by the adapter's content digest,
    or none for the base model): the keys its prefix cache stores those blocks under."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], digest)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class PrefixIndex:
    """Per replica, the block hashes of the requests routed to it, most recent last, at most
    `max_blocks_per_replica` each (the oldest are forgotten first, as an LRU prefix cache evicts)."""

    max_blocks_per_replica: int = 65536
    _blocks: dict[str, OrderedDict[bytes, None]] = field(default_factory=dict)

    def record(self, replica_id: str, hashes: Iterable[bytes], kv_blocks: int | None = None) -> None:
        """Remember that `replica_id` now holds these blocks (refreshing them if it did already). With
        `kv_blocks`, the replica's KV cache size, at most that many are kept for it: its engine cannot hold
        more, and evicts its least recently used cached blocks first, as this index forgets them."""
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        bound = min(self.max_blocks_per_replica, kv_blocks or self.max_blocks_per_replica)
        while len(held) > max(1, bound):
            held.popitem(last=False)

    def cached_blocks(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks `replica_id` is predicted to hold (a chained hash hits
        only if every block before it does, so counting stops at the first miss)."""
        held = self._blocks.get(replica_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        """Drop a replica that died (its replacement starts with an empty cache)."""
        self._blocks.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))


def score(
    view: ReplicaView,
    weights: RouterWeights,
    cached_tokens: int,
    prompt_tokens: int,
    digest: str | None,
) -> float:
    """The replica's score for a request of `prompt_tokens` tokens, `cached_tokens` of them predicted in
    its prefix cache, for adapter `digest` (None: the base model). Higher is better."""
    prefix = cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
    residency = view.residency(digest).value if digest is not None else 0.0
    return weights.prefix * prefix + weights.adapter * residency - weights.load * view.load()


def rank(
    views: Sequence[ReplicaView],
    index: PrefixIndex,
    weights: RouterWeights,
    hashes: Sequence[bytes],
    block_size: int,
    prompt_tokens: int,
    digest: str | None,
) -> list[ReplicaView]:
    """`views` best first by `score`. Ties (an idle cluster) go to fewer in-flight tokens, then fewer
    adapters held (so new adapters spread over idle replicas instead of piling onto one), then replica id
    (stable)."""

    def key(v: ReplicaView) -> tuple[float, int, int, str]:
        cached = index.cached_blocks(v.replica_id, hashes) * block_size
        held = len(v.device | v.host)
        return (-score(v, weights, cached, prompt_tokens, digest), v.in_flight_tokens, held, v.replica_id)

    return sorted(views, key=key)
