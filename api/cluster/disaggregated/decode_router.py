"""`DecodeRouter`: Ray Serve's request router for the decode deployment.

Ray's extension point (named by import path in the deployment's `RequestRouterConfig`, imported by Serve
in the ingress). `prepare(digest, name)` calls are ranked by `decode_score.rank` (adapter residency,
free KV blocks, load, from each replica's `record_routing_stats`), and so are `generate(digest, payload)`
calls (a short prompt served whole by a decode replica); `decode(target, handoff)` calls go to
`target`, the replica the request was prepared on, which holds its adapter by then; should that replica
be gone, to the best of the others (which loads the adapter itself).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from api.cluster.disaggregated.decode_score import DecodeView, DecodeWeights, rank


class DecodeRouter(RequestRouter):
    def initialize_state(  # type: ignore[override]
        self, w_adapter: float = 1.0, w_kv: float = 1.0, w_load: float = 1.0, max_seqs: int = 256
    ) -> None:
        self.weights = DecodeWeights(w_adapter, w_kv, w_load)
        self.max_seqs = max_seqs
        self.in_flight: dict[str, str] = {}  # internal request id -> replica (decode calls)
        self.count: dict[str, int] = {}  # replica -> decode calls in flight
        self.routed: dict[str, int] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        digest, prefer = _request(pending_request)
        return [[by_id[v.replica_id]] for v in rank(views, digest, self.weights, prefer)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if pending_request.metadata.call_method not in ("decode", "generate"):
            return
        rid = replica_id.unique_id
        self.in_flight[pending_request.metadata.internal_request_id] = rid
        self.count[rid] = self.count.get(rid, 0) + 1
        self.routed[rid] = self.routed.get(rid, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self.in_flight.pop(internal_request_id, None)
        if rid is not None:
            self.count[rid] = max(0, self.count.get(rid, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.count.pop(replica_id.unique_id, None)

    def _view(self, replica: RunningReplica) -> DecodeView:
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        return DecodeView(
            rid,
            device=frozenset(stats.get("device", ())),
            host=frozenset(stats.get("host", ())),
            kv_free=stats.get("kv_free"),
            kv_total=stats.get("kv_blocks"),
            max_seqs=self.max_seqs,
            in_flight=self.count.get(rid, 0),
        )


def _request(pending: PendingRequest | None) -> tuple[str | None, str | None]:
    """(adapter digest, preferred replica) of a `prepare(digest, name)`, `generate(digest, payload)` or
    `decode(target, handoff)`."""
    if pending is None or not pending.args:
        return None, None
    method, args = pending.metadata.call_method, pending.args
    if method in ("prepare", "generate"):
        return (args[0] if isinstance(args[0], str) and args[0] else None), None
    if method == "decode":
        digest = args[2] if len(args) > 2 and isinstance(args[2], str) else None
        return digest, (args[0] if isinstance(args[0], str) else None)
    return None, None
