"""Where the affinity router's backlog waits, without Ray: which replicas a request is offered to (Serve
holds it for those), an adapter's spread share under a queue, and the engine deployment's queue size."""

from __future__ import annotations

import math

import pytest

from api.cluster.options import QUEUE_FACTOR, ClusterOptions, RouterQueue, RouterWeights
from api.cluster.router_score import (
    PrefixIndex,
    ReplicaView,
    adapter_share,
    held_ranks,
    prompt_block_hashes,
    rank,
    score,
    share,
)
from api.settings import ServerSettings
from tests.api.cluster.conftest import DEMO

BS = 4
DIGEST = "ab" * 32  # an adapter content digest


def _scored(views: list[ReplicaView], tokens: list[int], digest: str | None, index: PrefixIndex):
    hashes = prompt_block_hashes(tokens, BS, digest)
    ranked = rank(views, index, RouterWeights(), hashes, BS, len(tokens), digest)
    return [(v.replica_id, score(v, RouterWeights(), c, len(tokens), digest)) for v, c in ranked]


def test_a_request_is_held_for_the_replica_whose_affinity_outweighs_its_queue() -> None:
    """Both replicas equally full: the one holding the prompt's prefix and the adapter is the only rank,
    so Serve waits for it instead of sending the request to whichever replica frees a slot first."""
    tokens = list(range(64))
    index = PrefixIndex()
    index.record("a", prompt_block_hashes(tokens, BS, "d"))
    full = {"budget_tokens": 10_000, "max_seqs": 16, "in_flight_requests": 16, "in_flight_tokens": 1000}
    views = [
        ReplicaView("a", device=frozenset({"d"}), free_slot=False, **full),
        ReplicaView("b", free_slot=False, **full),
    ]
    scored = _scored(views, tokens, "d", index)
    assert [r for r, _ in scored] == ["a", "b"]
    assert held_ranks(scored, 1.0) == [["a"]]
    assert held_ranks(scored, math.inf) == [["a"], ["b"]]  # the old behaviour: every replica, best first


def test_a_long_enough_queue_on_the_best_replica_releases_the_hold() -> None:
    """The load term bounds the hold: once the best replica's queue costs more than its affinity is worth
    (beyond the margin), the other replica is offered too, after it."""
    tokens = list(range(64))
    index = PrefixIndex()
    index.record("a", prompt_block_hashes(tokens, BS, None))
    views = [
        ReplicaView("a", budget_tokens=10_000, max_seqs=16),
        ReplicaView("b", budget_tokens=10_000, max_seqs=16),
    ]
    offered = []
    for queued in (0, 16, 32, 64):
        views[0].in_flight_requests = queued
        offered.append([rank[0] for rank in held_ranks(_scored(views, tokens, None, index), 0.5)])
    # the prefix is worth 1.0: "a" alone while its load (queued / 16) is under 0.5; both, best first,
    # while the scores are within the margin; "b" alone once a's queue outweighs the prefix by more
    assert offered == [["a"], ["a", "b"], ["b"], ["b"]]


def test_held_ranks_keeps_every_replica_within_the_margin_in_score_order() -> None:
    scored = [("x", 2.0), ("y", 1.9), ("z", 0.5)]
    assert held_ranks(scored, 0.2) == [["x"], ["y"]]
    assert held_ranks(scored, 0.0) == [["x"]]
    assert held_ranks([], 1.0) == []


def test_an_adapter_is_hot_by_its_share_of_a_queued_replica_not_by_the_queue() -> None:
    """Under a backlog (64 requests in flight on a 16-seq replica), an adapter with 10 of them is a small
    part of the replica's work: not hot, though it has more requests in flight than half a batch."""
    view = ReplicaView("a", budget_tokens=100_000, max_seqs=16, in_flight_requests=64, in_flight_tokens=6400)
    assert share(view, 1000, 10) == pytest.approx(10 / 16)
    assert adapter_share(view, 1000, 10) == pytest.approx(10 / 64)
    assert adapter_share(view, 4800, 48) == pytest.approx(0.75)  # most of the queue: hot
    idle = ReplicaView("b", budget_tokens=100_000, max_seqs=16, in_flight_requests=10, in_flight_tokens=1000)
    assert adapter_share(idle, 1000, 10) == share(idle, 1000, 10)  # no queue: the capacity share


def test_the_affinity_router_lets_the_engines_queue_the_backlog(tmp_path) -> None:
    from api.cluster.deployments import engine_deployment, engine_max_ongoing

    settings = ServerSettings.build(str(DEMO / "base"), env={"LORAPLEX_DATA_DIR": str(tmp_path)})
    seqs = settings.engine.max_num_seqs
    config = engine_deployment(settings, ClusterOptions(2))._deployment_config
    assert config.max_ongoing_requests == QUEUE_FACTOR * seqs
    assert config.request_router_config.request_router_kwargs["hold_margin"] == RouterQueue().hold_margin
    custom = ClusterOptions(2, queue=RouterQueue(max_ongoing=40, hold_margin=0.25))
    config = engine_deployment(settings, custom)._deployment_config
    assert config.max_ongoing_requests == 40
    assert config.request_router_config.request_router_kwargs["hold_margin"] == 0.25
    # Serve's multiplexing keeps its queue in Serve, as before (at most a batch per replica)
    assert engine_max_ongoing(settings, ClusterOptions(2, router="multiplex")) == max(8, seqs)


@pytest.mark.parametrize(
    ("queue", "message"),
    [
        (RouterQueue(max_ongoing=0), "--router-max-ongoing"),
        (RouterQueue(hold_margin=-1), "--router-hold-margin"),
    ],
)
def test_impossible_queues_are_refused(queue: RouterQueue, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterOptions(2, queue=queue).validate()


class _Replica:
    """The two attributes of Ray's `RunningReplica` the router reads (no Ray cluster needed)."""

    def __init__(self, rid: str, stats: dict) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(rid, DeploymentID(name="EngineReplica", app_name="loraplex"))
        self.routing_stats = stats


def _pending(request_id: str, tokens: list[int], digest: str | None):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    from api.engine_protocol import AddRequest, encode
    from engine import LoRARequest, SamplingParams

    lora = LoRARequest("support", "", digest) if digest is not None else None
    req = AddRequest(request_id, tokens, SamplingParams(max_tokens=4), lora=lora)
    meta = RequestMetadata(request_id, request_id, call_method="generate")
    return PendingRequest([encode(req)], {}, meta)


def test_serve_backs_off_and_holds_a_request_for_its_adapters_replica(monkeypatch) -> None:
    """Ray's `RequestRouter` contract: the router asks Serve to back off between passes (without it
    Serve asks again at once, in a loop, while the offered replicas are full), offers only the replica
    the adapter is on, and does not decode a request again when Serve asks again."""
    import asyncio

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from api.cluster import affinity_router
    from api.cluster.affinity_router import AffinityRouter

    async def main() -> None:
        router = AffinityRouter(
            DeploymentID(name="EngineReplica", app_name="loraplex"), DeploymentHandleSource.UNKNOWN
        )
        router.initialize_state(block_size=BS, hold_margin=1.0)
        stats = {"budget_tokens": 10_000, "max_num_seqs": 16, "free_slot": False}
        a = _Replica("a", {**stats, "device": [DIGEST]})
        b = _Replica("b", dict(stats))
        first = _pending("r1", list(range(64)), DIGEST)
        ranks = await router.choose_replicas([a, b], first)
        assert first.routing_context.should_backoff
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["a"]]
        decoded = []
        real = affinity_router._add_request
        monkeypatch.setattr(affinity_router, "_add_request", lambda p: decoded.append(p) or real(p))
        again = await router.choose_replicas([a, b], first)  # "a" was full: Serve asks again
        assert [[r.replica_id.unique_id for r in rank] for rank in again] == [["a"]] and decoded == []
        base = _pending("r2", [7] * 40, None)  # base model, no prefix anywhere: both, a tie
        both = await router.choose_replicas([a, b], base)
        assert sorted(r.replica_id.unique_id for rank in both for r in rank) == ["a", "b"]

    asyncio.run(main())


def test_routed_blocks_stay_predicted_until_the_replica_itself_reports_again() -> None:
    """Serve re-sends every replica's last report whenever any replica reports (new dict objects, same
    content): only a report with a new sequence number may retire what was routed to that replica."""
    import asyncio

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from api.cluster.affinity_router import AffinityRouter

    async def main() -> None:
        router = AffinityRouter(
            DeploymentID(name="EngineReplica", app_name="loraplex"), DeploymentHandleSource.UNKNOWN
        )
        router.initialize_state(block_size=BS, prefix_ttl_s=0.0)  # any later report of the replica covers
        stats = {"budget_tokens": 10_000, "max_num_seqs": 16, "free_slot": True, "report": 1}
        a, b = _Replica("a", dict(stats)), _Replica("b", dict(stats))
        prompt = list(range(100, 100 + 3 * BS))
        first = _pending("p1", prompt, None)
        await router.choose_replicas([a, b], first)
        router.on_request_routed(first, a.replica_id, None)

        async def predicted_on_a(request_id: str) -> int:
            await router.choose_replicas([a, b], _pending(request_id, [*prompt, 1, 2], None))
            return router._pending[request_id][1]["a"]

        assert await predicted_on_a("p2") == 3 * BS
        a.routing_stats, b.routing_stats = dict(a.routing_stats), {**stats, "report": 2}  # b reported
        assert await predicted_on_a("p3") == 3 * BS, "a's re-sent report retired a's routed blocks"
        a.routing_stats = {**stats, "report": 2}  # a's own new report (its summary: nothing held)
        assert await predicted_on_a("p4") == 0

    asyncio.run(main())
