"""The affinity router's score of one engine replica for one request, as plain code (no Ray).

    score = w_prefix · (predicted cached prefix tokens / prompt tokens)
          + w_adapter · residency
          − w_load · load

* The prefix term predicts what the replica's engine will find in its prefix cache. The prompt's full
  blocks are hashed with the engine's own chained block hash (`engine.kv_cache.block_pool.hash_block`,
  keyed by `block_key`: the adapter's *content digest*, the key the engine itself uses), so a predicted
  hit is a hit the engine has, and a name re-registered with other weights (a new digest) predicts no hit
  on the old blocks. What a replica holds comes from the replica itself: a Bloom filter of the blocks its
  engine has cached (`api.cluster.prefix_report`, evicted blocks removed), reported every second; the
  blocks of requests routed to it since (`PrefixIndex`, forgotten once a report that arrived `ttl_s`
  or more after their routing covers them) fill the gap until its next report.
* Residency of the request's adapter on the replica: device-resident > host-cached > a free device slot
  > must evict another adapter (0 for base-model requests: every replica holds the base model).
* Load: of the requests routed to the replica and not yet finished, their prompt + maximum new tokens
  over the replica's token budget (its KV cache), or their number over its `max_num_seqs`, the higher.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

from api.cluster.options import RouterWeights
from api.cluster.prefix_report import BlockSummary
from engine.kv_cache.block_pool import block_key, hash_block

__all__ = [
    "PrefixIndex",
    "ReplicaView",
    "Residency",
    "RouterWeights",
    "adapter_share",
    "held_ranks",
    "prompt_block_hashes",
    "rank",
    "score",
    "share",
]


class Residency(float, enum.Enum):
    """Where the request's adapter is on a replica, as the residency term's value (1 is best)."""

    DEVICE = 1.0  # in the device pool: no load at all
    HOST = 0.6  # cached in host memory: one upload to the device
    FREE_SLOT = 0.3  # not there, but a device slot is free: a load, no eviction
    MUST_EVICT = 0.0  # not there and the pool is full: a load that evicts another adapter


@dataclass(slots=True)
class ReplicaView:
    """What the router knows of one replica: from its routing stats, its adapters by tier (content
    digests), whether its device pool has a free slot, its token budget and `max_num_seqs`, and the
    summary of the blocks its prefix cache holds; kept by the router, the tokens and the number of the
    requests routed to it that have not finished."""

    replica_id: str
    device: frozenset[str] = frozenset()
    host: frozenset[str] = frozenset()
    free_slot: bool = True
    budget_tokens: int = 1
    in_flight_tokens: int = 0
    max_seqs: int = 1 << 30
    in_flight_requests: int = 0
    held: BlockSummary | None = None

    def residency(self, digest: str) -> Residency:
        """The residency of adapter `digest` on this replica."""
        if digest in self.device:
            return Residency.DEVICE
        if digest in self.host:
            return Residency.HOST
        return Residency.FREE_SLOT if self.free_slot else Residency.MUST_EVICT

    def load(self) -> float:
        """How full the replica is with what was routed to it (1.0: a full KV cache's worth of tokens, or
        `max_num_seqs` requests)."""
        return share(self, self.in_flight_tokens, self.in_flight_requests)


def share(view: ReplicaView, tokens: int, requests: int) -> float:
    """`tokens` over the replica's budget or `requests` over its `max_num_seqs`, the higher."""
    return max(tokens / max(1, view.budget_tokens), requests / max(1, view.max_seqs))


def adapter_share(view: ReplicaView, tokens: int, requests: int) -> float:
    """An adapter's share of the replica's capacity, from its `tokens` and `requests` in flight there: as
    `share` while the replica is under its budget and `max_num_seqs`; past them (requests queue in its
    engine), its share of what is in flight there, so that a backlog makes no adapter look hot that
    takes a small part of the replica's work."""
    return max(
        tokens / max(1, view.budget_tokens, view.in_flight_tokens),
        requests / max(1, view.max_seqs, view.in_flight_requests),
    )


def held_ranks(scored: Sequence[tuple[str, float]], hold_margin: float) -> list[list[str]]:
    """Serve's ranks for one request, from its allowed replicas with their scores, best first: each replica
    its own rank, leaving out those scored more than `hold_margin` below the best. Serve offers the request
    to the first rank whose replica is under `max_ongoing_requests`, the next rank only when it is full,
    and with every offered replica full it backs off and asks again; so the request is held for the
    replicas near the best instead of going to whichever replica frees a slot first. The hold is bounded
    by the load term (in the score): as the best replica's queue grows its score falls, until the others
    come within the margin (or ahead). The best is always offered."""
    if not scored:
        return []
    best = max(s for _, s in scored)
    return [[r] for r, s in scored if s >= best - hold_margin]


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, digest: str | None, long_prompt_from: int | None = None
) -> list[bytes]:
    """The engine's hashes of the prompt's full blocks (chained, keyed as the engine keys them: by the
    adapter's content digest, none for the base model): the keys its prefix cache stores them under."""
    key = block_key(digest, len(token_ids), long_prompt_from)
    hashes: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], key)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class PrefixIndex:
    """Per replica, the block hashes of the requests routed to it, most recent last, at most
    `max_blocks_per_replica` each: what the replica caches before a report of its own says so.

    A routed block counts until the replica's report can cover it: until a report arrives `ttl_s` or more
    after the block was routed (the replica had that long to compute the block and report it). Expiry
    follows the reports, not the clock alone, so a replica whose reports are late (a loaded machine, a
    slow stats call) is not forgotten meanwhile. `cached_blocks` counts a block as held if the replica's
    report (`held`) or this index has it."""

    max_blocks_per_replica: int = 65536
    ttl_s: float = 5.0
    _blocks: dict[str, OrderedDict[bytes, float]] = field(default_factory=dict)
    _reported: dict[str, float] = field(default_factory=dict)  # replica -> when its latest report came

    def record(
        self, replica_id: str, hashes: Iterable[bytes], kv_blocks: int | None = None, now: float | None = None
    ) -> None:
        """Remember that `replica_id` is computing these blocks now. With `kv_blocks`, the replica's KV
        cache size, at most that many are kept for it (it cannot hold more; LRU, as its engine evicts)."""
        t = time.monotonic() if now is None else now
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for h in hashes:
            held[h] = t
            held.move_to_end(h)
        bound = min(self.max_blocks_per_replica, kv_blocks or self.max_blocks_per_replica)
        while len(held) > max(1, bound):
            held.popitem(last=False)
        self._drop_covered(replica_id)

    def reported(self, replica_id: str, now: float | None = None) -> None:
        """A new report of `replica_id` arrived (now): the blocks routed `ttl_s` or more before it are
        left to the report."""
        self._reported[replica_id] = time.monotonic() if now is None else now
        self._drop_covered(replica_id)

    def _drop_covered(self, replica_id: str) -> None:
        held = self._blocks.get(replica_id)
        covered = self._reported.get(replica_id, float("-inf")) - self.ttl_s
        while held and next(iter(held.values())) <= covered:
            held.popitem(last=False)

    def cached_blocks(
        self, replica_id: str, hashes: Sequence[bytes], held: BlockSummary | None = None
    ) -> int:
        """How many of the prompt's leading blocks `replica_id` is predicted to hold, by its report `held`
        or by recent routing (a chained hash hits only if every block before it does, so counting stops at
        the first miss)."""
        recent: dict[bytes, float] = self._blocks.get(replica_id) or {}
        covered = self._reported.get(replica_id, float("-inf")) - self.ttl_s
        n = 0
        for h in hashes:
            if not ((held is not None and held.contains(h)) or recent.get(h, covered) > covered):
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        """Drop a replica that died (its replacement starts with an empty cache)."""
        self._blocks.pop(replica_id, None)
        self._reported.pop(replica_id, None)

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
    preferred: Set[str] = frozenset(),
) -> list[tuple[ReplicaView, int]]:
    """(view, predicted cached tokens) best first: the `preferred` replicas (where the adapter is placed)
    before the others, each group by `score`. Ties (an idle cluster) go to fewer in-flight tokens, then
    fewer adapters held (so new adapters spread over idle replicas instead of piling onto one), then
    replica id (stable)."""
    cached = {v.replica_id: index.cached_blocks(v.replica_id, hashes, v.held) * block_size for v in views}

    def key(v: ReplicaView) -> tuple[bool, float, int, int, str]:
        held = len(v.device | v.host)
        s = score(v, weights, cached[v.replica_id], prompt_tokens, digest)
        return (v.replica_id not in preferred, -s, v.in_flight_tokens, held, v.replica_id)

    return [(v, cached[v.replica_id]) for v in sorted(views, key=key)]
