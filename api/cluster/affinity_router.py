"""`AffinityRouter`: Ray Serve's request router for the engine deployment (`--router affinity`).

This module is Ray's extension point (a `ray.serve.request_router.RequestRouter` subclass, named by its
import path in the deployment's `RequestRouterConfig`, see `ray_api.affinity_router_config`): Serve
imports it in every process that holds a handle to the engine deployment (the ingress replicas), and
nothing else in loraplex imports it.

For each `generate` call it decodes the request (the ingress tokenized it once: `prompt_token_ids`),
hashes the prompt's blocks with the engine's own chained block hash keyed by the adapter's content digest,
and ranks the live replicas by `router_score.score`: predicted prefix hit (each replica's report of the
blocks its engine holds, plus what was routed there since), adapter residency (each replica's
`record_routing_stats`: its adapters by tier, whether its pool has a free slot), and the tokens and
requests routed to it that have not finished, over its KV budget and `max_num_seqs`. An adapter's request
goes only to the replicas its placement names (`placement.Placements`: one replica, more while the
adapter is hot, rebalanced when a replica comes back), best first; base-model requests may go to any.
Each replica is its own rank, so Serve tries the best first and falls to the next only when that one's
queue is full (`max_ongoing_requests`); replicas scored more than `hold_margin` below the best are not
offered at all, so Serve holds the request for the better ones (`router_score.held_ranks`). Other calls
go to the replica with the fewest tokens in flight.
Counters and placements are published for the ingress (`router_stats`).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from api.cluster import router_stats
from api.cluster.options import (
    CONTRACT_AFTER_S,
    HOLD_MARGIN,
    MAX_SPREAD,
    SPREAD_LOAD,
    W_ADAPTER,
    W_LOAD,
    W_PREFIX,
    SpreadPolicy,
)
from api.cluster.placement import Placements
from api.cluster.prefix_report import BlockSummary
from api.cluster.router_score import (
    PrefixIndex,
    ReplicaView,
    RouterWeights,
    adapter_share,
    held_ranks,
    prompt_block_hashes,
    rank,
    score,
)
from api.engine_protocol import AddRequest, decode_to_engine
from engine.lora.mix import mix_key

log = logging.getLogger("loraplex.router")
MAX_PENDING = 4096  # requests being routed whose block hashes are kept until Serve names their replica


class _InFlight:
    """One routed request that has not finished: where, how many tokens, which adapter."""

    __slots__ = ("digest", "replica", "tokens")

    def __init__(self, replica: str, tokens: int, digest: str | None) -> None:
        self.replica, self.tokens, self.digest = replica, tokens, digest


class AffinityRouter(RequestRouter):
    """Prefix-, adapter- and load-aware routing with bounded spreading of hot adapters (module doc)."""

    def initialize_state(  # type: ignore[override]
        self,
        block_size: int = 16,
        w_prefix: float = W_PREFIX,
        w_adapter: float = W_ADAPTER,
        w_load: float = W_LOAD,
        spread_load: float = SPREAD_LOAD,
        max_spread: int = MAX_SPREAD,
        contract_after_s: float = CONTRACT_AFTER_S,
        max_blocks_per_replica: int = 65536,
        prefix_ttl_s: float = 5.0,
        hold_margin: float = HOLD_MARGIN,
    ) -> None:
        """Called by Serve with the config's `request_router_kwargs`."""
        self.block_size = block_size
        self.weights = RouterWeights(w_prefix, w_adapter, w_load)
        self.hold_margin = hold_margin
        self.index = PrefixIndex(max_blocks_per_replica, prefix_ttl_s)
        self.placements = Placements(SpreadPolicy(spread_load, max_spread, contract_after_s))
        self.stats = router_stats.RouterStats(self.placements)
        router_stats.publish(self.stats)
        self.in_flight: dict[str, _InFlight] = {}  # internal request id -> where it went
        self.tokens: dict[str, int] = {}  # replica -> tokens of its requests in flight
        self.requests: dict[str, int] = {}  # replica -> its requests in flight
        self.adapter_tokens: dict[tuple[str, str], int] = {}  # (digest, replica) -> tokens in flight
        self.adapter_requests: dict[tuple[str, str], int] = {}  # (digest, replica) -> requests in flight
        self._pending: dict[str, tuple[list[bytes], dict[str, int]]] = {}  # id -> hashes, predicted hits
        # id -> the decoded request and its block hashes, while Serve asks again for it (a full replica)
        self._decoded: dict[str, tuple[AddRequest, list[bytes]]] = {}
        # requests chosen for a replica that has not accepted them yet (Serve asks it first): counted
        # there meanwhile, so that a burst routed at once sees its own load
        self._tentative: dict[str, _InFlight] = {}
        self._summaries: dict[str, tuple[Any, BlockSummary | None]] = {}  # replica -> (its report, parsed)
        self._reports: dict[str, int] = {}  # replica -> the sequence number of its latest report seen

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The candidates allowed for the request, one per rank, best first. When every offered replica
        is full, Serve backs off (`should_backoff`: 25 ms doubling to 0.5 s) before it asks again, instead
        of asking at once in a loop; a request asked about again is not decoded or hashed again."""
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = pending_request.metadata.internal_request_id if pending_request is not None else None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if key is not None:
            self._tentative.pop(key, None)  # asked again (its first choice was full): not counted twice
        views = [self._view(r) for r in candidate_replicas]
        seen = self._decoded.get(key) if key is not None else None
        req = seen[0] if seen is not None else _add_request(pending_request)
        if req is None:
            ordered = sorted(views, key=lambda v: (v.in_flight_tokens, v.replica_id))
            return [[by_id[v.replica_id]] for v in ordered]
        digest = _adapter_key(req)
        tokens = req.prompt_token_ids
        hashes = seen[1] if seen is not None else prompt_block_hashes(tokens, self.block_size, digest)
        ranked = rank(views, self.index, self.weights, hashes, self.block_size, len(tokens), digest)
        order = [v.replica_id for v, _ in ranked]
        if digest is not None:
            assert req.lora is not None
            allowed = set(self._place(digest, req.lora.name, order, {v.replica_id: v for v in views}))
            ranked = [(v, cached) for v, cached in ranked if v.replica_id in allowed]
        scored = [(v.replica_id, score(v, self.weights, c, len(tokens), digest)) for v, c in ranked]
        order = [r for (r,) in held_ranks(scored, self.hold_margin)]
        if key is not None:
            predicted = {v.replica_id: cached for v, cached in ranked}
            self._pending[key] = (hashes, predicted)
            self._decoded[key] = (req, hashes)
            self._tentative[key] = _InFlight(order[0], len(tokens) + req.params.max_tokens, digest)
            for table in (self._pending, self._tentative, self._decoded):
                while len(table) > MAX_PENDING:  # requests cancelled before Serve routed them
                    del table[next(iter(table))]
        return [[by_id[r]] for r in order]

    def _place(self, digest: str, name: str, order: list[str], views: dict[str, ReplicaView]) -> list[str]:
        """The adapter's placement after this request's look at its load (`Placements.place`)."""
        tentative = [t for t in self._tentative.values() if t.digest == digest]
        load = {}
        for r, v in views.items():
            mine = [t.tokens for t in tentative if t.replica == r]
            tokens = self.adapter_tokens.get((digest, r), 0) + sum(mine)
            load[r] = adapter_share(v, tokens, self.adapter_requests.get((digest, r), 0) + len(mine))
        placed = self.placements.place(
            digest, name, order, load, busy=lambda r: self.adapter_requests.get((digest, r), 0) > 0
        )
        self.stats.protected = self.placements.protected()
        return placed

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count the request's tokens on its replica and remember the blocks it will cache there."""
        rid = replica_id.unique_id
        key = pending_request.metadata.internal_request_id
        self._tentative.pop(key, None)
        rerouted = self._release(key)  # a replica that rejected it (queue full) gave it back to Serve
        seen = self._decoded.pop(key, None)
        req = seen[0] if seen is not None else _add_request(pending_request)
        tokens = len(req.prompt_token_ids) + req.params.max_tokens if req is not None else 1
        digest = _adapter_key(req) if req is not None else None
        self.in_flight[key] = _InFlight(rid, tokens, digest)
        _add(self.tokens, rid, tokens)
        _add(self.requests, rid, 1)
        if digest is not None:
            _add(self.adapter_tokens, (digest, rid), tokens)
            _add(self.adapter_requests, (digest, rid), 1)
        hashes, predicted = self._pending.pop(key, ([], {}))
        if req is not None and not rerouted:
            self.stats.routed_to(rid, len(req.prompt_token_ids), predicted.get(rid, 0))
        if hashes:
            replica = self.curr_replicas.get(replica_id)
            stats = (replica.routing_stats if replica is not None else None) or {}
            self.index.record(rid, hashes, kv_blocks=stats.get("kv_blocks"))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve calls this for every attempt, also one a replica rejected (its callback may come after
        the request was routed again, elsewhere): only the attempt on the counted replica is released."""
        self._pending.pop(internal_request_id, None)
        self._decoded.pop(internal_request_id, None)
        tentative = self._tentative.get(internal_request_id)
        if tentative is not None and tentative.replica == replica_id.unique_id:
            del self._tentative[internal_request_id]  # its replica rejected it, or it failed there
        self._release(internal_request_id, replica_id.unique_id)

    def _release(self, key: str, replica: str | None = None) -> bool:
        """Stop counting request `key` (if counted on `replica`, when given); False if it was not."""
        entry = self.in_flight.get(key)
        if entry is None or (replica is not None and entry.replica != replica):
            return False
        del self.in_flight[key]
        _add(self.tokens, entry.replica, -entry.tokens)
        _add(self.requests, entry.replica, -1)
        if entry.digest is not None:
            _add(self.adapter_tokens, (entry.digest, entry.replica), -entry.tokens)
            _add(self.adapter_requests, (entry.digest, entry.replica), -1)
        return True

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self.index.forget(rid)
        self.placements.forget_replica(rid)
        self.stats.protected = self.placements.protected()
        self._summaries.pop(rid, None)
        self._reports.pop(rid, None)
        for counts in (self.tokens, self.requests):
            counts.pop(rid, None)

    def _view(self, replica: RunningReplica) -> ReplicaView:
        """The router's view of `replica`: its routing stats (empty until its first report) and the
        tokens and requests this router has in flight there."""
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        seq = stats.get("report")
        if seq is not None and self._reports.get(rid) != seq:  # a new report (not Serve re-sending the last)
            self._reports[rid] = seq
            self.index.reported(rid)  # the blocks routed ttl_s before it are left to it
        waiting = [t.tokens for t in self._tentative.values() if t.replica == rid]
        return ReplicaView(
            rid,
            device=frozenset(stats.get("device", ())),
            host=frozenset(stats.get("host", ())),
            free_slot=bool(stats.get("free_slot", True)),
            budget_tokens=int(stats.get("budget_tokens", 1) or 1),
            in_flight_tokens=self.tokens.get(rid, 0) + sum(waiting),
            max_seqs=int(stats.get("max_num_seqs") or 1 << 30),
            in_flight_requests=self.requests.get(rid, 0) + len(waiting),
            held=self._summary(rid, stats.get("prefix")),
        )

    def _summary(self, rid: str, reported: Any) -> BlockSummary | None:
        """The replica's prefix-cache summary, parsed once per report."""
        seen = self._summaries.get(rid)
        if seen is not None and seen[0] is reported:
            return seen[1]
        parsed = BlockSummary.from_stats(reported)
        self._summaries[rid] = (reported, parsed)
        return parsed


def _add(counts: dict, key: Any, n: int) -> None:
    """counts[key] += n, dropping keys that reach zero."""
    v = counts.get(key, 0) + n
    if v > 0:
        counts[key] = v
    else:
        counts.pop(key, None)


def _adapter_key(req: AddRequest) -> str | None:
    """The key the engine caches the request's blocks under: its adapter's content digest, a weighted
    mix's `mix_key` over its members' digests (None: the base model)."""
    lr = req.lora
    if lr is None:
        return None
    if lr.mix:
        digests = [m.digest for m, _ in lr.mix]
        if any(d is None for d in digests):
            return lr.name  # not predicted; never a base-model hit
        return mix_key([d for d in digests if d is not None], [w for _, w in lr.mix])
    return lr.digest


def _add_request(pending: PendingRequest | None) -> AddRequest | None:
    """The engine request a `generate(payload)` call carries, or None for any other call."""
    if pending is None or pending.metadata.call_method != "generate" or not pending.args:
        return None
    payload = pending.args[0]
    if not isinstance(payload, bytes):
        return None
    try:
        req = decode_to_engine(payload)
    except Exception:  # not an engine request: route by load only
        return None
    return req if isinstance(req, AddRequest) else None
