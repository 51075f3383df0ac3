"""`AffinityRouter`: Ray Serve's request router for the engine deployment (`--router affinity`).

This module is Ray's extension point (a `ray.serve.request_router.RequestRouter` subclass, named by its
import path in the deployment's `RequestRouterConfig`, see `ray_api.affinity_router_config`): Serve
imports it in every process that holds a handle to the engine deployment (the ingress replicas), and
nothing else in loraplex imports it.

For each `generate` call it decodes the request (the ingress tokenized it once: `prompt_token_ids`),
hashes the prompt's blocks with the engine's own chained block hash keyed by the adapter's content digest,
and ranks the live replicas by `router_score.score`: predicted prefix hit, adapter residency (from each
replica's `record_routing_stats`: its adapters by tier and whether its pool has a free slot), and the
tokens routed to it that have not finished, over its KV budget. Each replica is its own rank, so Serve
tries the best first and falls to the next only when that one's queue is full (`max_ongoing_requests`).
Other calls (none today) go to the replica with the fewest tokens in flight.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from api.cluster.router_score import PrefixIndex, ReplicaView, RouterWeights, prompt_block_hashes, rank
from api.engine_protocol import AddRequest, decode_to_engine

log = logging.getLogger("loraplex.router")


class AffinityRouter(RequestRouter):
    """Prefix-, adapter- and load-aware routing (see the module doc)."""

    def initialize_state(  # type: ignore[override]
        self,
        block_size: int = 16,
        w_prefix: float = 1.0,
        w_adapter: float = 1.0,
        w_load: float = 2.0,
        max_blocks_per_replica: int = 65536,
    ) -> None:
        """Called by Serve with the config's `request_router_kwargs`."""
        self.block_size = block_size
        self.weights = RouterWeights(w_prefix, w_adapter, w_load)
        self.index = PrefixIndex(max_blocks_per_replica)
        self.in_flight: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, tokens)
        self.tokens: dict[str, int] = {}  # replica -> tokens of its requests in flight
        self._pending: dict[str, list[bytes]] = {}  # internal request id -> its block hashes
        self.routed: dict[str, int] = {}  # replica -> requests routed there (for tests and logs)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate, one per rank, best first."""
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        req = _add_request(pending_request)
        if req is None:
            ordered = sorted(views, key=lambda v: (v.in_flight_tokens, v.replica_id))
        else:
            digest = req.lora.digest if req.lora is not None else None
            tokens = req.prompt_token_ids
            hashes = prompt_block_hashes(tokens, self.block_size, digest)
            if pending_request is not None:
                self._pending[pending_request.metadata.internal_request_id] = hashes
            ordered = rank(views, self.index, self.weights, hashes, self.block_size, len(tokens), digest)
        return [[by_id[v.replica_id]] for v in ordered]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count the request's tokens on its replica and remember the blocks it will cache there."""
        rid = replica_id.unique_id
        key = pending_request.metadata.internal_request_id
        req = _add_request(pending_request)
        tokens = len(req.prompt_token_ids) + req.params.max_tokens if req is not None else 1
        self.in_flight[key] = (rid, tokens)
        self.tokens[rid] = self.tokens.get(rid, 0) + tokens
        self.routed[rid] = self.routed.get(rid, 0) + 1
        hashes = self._pending.pop(key, None)
        if hashes:
            replica = self.curr_replicas.get(replica_id)
            stats = (replica.routing_stats if replica is not None else None) or {}
            self.index.record(rid, hashes, kv_blocks=stats.get("kv_blocks"))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._pending.pop(internal_request_id, None)
        entry = self.in_flight.pop(internal_request_id, None)
        if entry is not None:
            rid, tokens = entry
            self.tokens[rid] = max(0, self.tokens.get(rid, 0) - tokens)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)
        self.tokens.pop(replica_id.unique_id, None)

    def _view(self, replica: RunningReplica) -> ReplicaView:
        """The router's view of `replica`: its routing stats (empty until its first report) and the
        tokens this router has in flight there."""
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        return ReplicaView(
            rid,
            device=frozenset(stats.get("device", ())),
            host=frozenset(stats.get("host", ())),
            free_slot=bool(stats.get("free_slot", True)),
            budget_tokens=int(stats.get("budget_tokens", 1) or 1),
            in_flight_tokens=self.tokens.get(rid, 0),
        )


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
