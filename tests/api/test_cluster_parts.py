"""The Ray-free parts of `api.cluster`: pool capacity, merged replica statistics, the replica header."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from api.cluster.deployments import pool_capacity
from api.cluster.remote_client import merge_stats
from api.cluster.replica_header import HEADER, ReplicaHeaderMiddleware, note_replica
from api.engine_protocol import EngineStatsMsg
from engine.engine_config import EngineConfig


def test_multiplexed_capacity_follows_the_pool() -> None:
    assert pool_capacity(EngineConfig(model=".", max_loras=8, max_lora_rank=64)) == 16
    assert pool_capacity(EngineConfig(model=".", max_loras=4, max_lora_rank=16)) == 8
    assert pool_capacity(EngineConfig(model=".", max_lora_rank=32, lora_pool_pages=7)) == 3


def _stats(running: int, used: int, total: int, names: list[str], loads: int) -> EngineStatsMsg:
    engine = {"num_running": running, "kv_blocks_used": used, "kv_blocks_total": total, "kv_usage": 0.0}
    engine["running_loras"] = names
    adapters = [{"digest": n, "names": [n], "tier": "device", "pinned": False} for n in names]
    return EngineStatsMsg(engine, {"loads": loads, "pages_used": 1}, adapters)


def test_merge_stats_sums_and_unions() -> None:
    one, two = _stats(2, 10, 100, ["a"], 3), _stats(1, 30, 100, ["b", "a"], 4)
    one.engine["spec_by_adapter"] = {"a": [10, 6, 2]}
    two.engine["spec_by_adapter"] = {"a": [4, 1, 1], "b": [3, 3, 1]}
    merged = merge_stats([one, two])
    assert merged is not None and merge_stats([]) is None
    assert merged.engine["num_running"] == 3 and merged.engine["kv_usage"] == pytest.approx(0.2)
    assert merged.engine["running_loras"] == ["a", "b"]
    assert merged.lora == {"loads": 7, "pages_used": 2} and len(merged.adapters) == 3
    assert merged.engine["spec_by_adapter"] == {"a": [14, 7, 3], "b": [3, 3, 1]}


@pytest.mark.anyio
async def test_header_names_the_replicas_that_served() -> None:
    app = FastAPI()

    @app.get("/one")
    async def one() -> dict:
        note_replica("r1")
        note_replica("r2")
        note_replica("r1")
        return {}

    @app.get("/none")
    async def none() -> dict:
        return {}

    app.add_middleware(ReplicaHeaderMiddleware)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/one")).headers[HEADER] == "r1,r2"
        assert HEADER not in (await c.get("/none")).headers


def test_gateway_gauges_per_replica_carry_a_replica_label() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from api.gateway_metrics import GatewayGauges

    registry = CollectorRegistry()
    gauges = GatewayGauges(registry, per_replica=True)
    one, two = _stats(2, 10, 100, ["a"], 3), _stats(1, 30, 100, ["b"], 4)
    for s in (one, two):
        s.engine["num_waiting"] = 0
    gauges.refresh_replicas([("r1", one.engine, one.adapters), ("r2", two.engine, two.adapters)], max_loras=4)

    def samples(name: str) -> dict[str, list]:
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
        out: dict[str, list] = {}
        for s in families[name].samples:
            out.setdefault(s.labels["replica"], []).append(s)
        return out

    running = samples("vllm:num_requests_running")
    assert {r: [s.value for s in v] for r, v in running.items()} == {"r1": [2.0], "r2": [1.0]}
    info = samples("vllm:lora_requests_info")
    assert info["r1"][0].labels["max_lora"] == info["r2"][0].labels["max_lora"] == "4"
    assert info["r2"][0].labels["running_lora_adapters"] == "b"
    resident = samples("loraplex_lora_adapter_resident")
    assert [s.labels["adapter"] for s in resident["r1"]] == ["a"]
    gauges.refresh_replicas([("r2", two.engine, two.adapters)], max_loras=4)  # r1 was replaced
    assert set(samples("vllm:num_requests_running")) == {"r2"}
    assert set(samples("loraplex_lora_adapter_resident")) == {"r2"}


def test_pool_view_lists_each_replica_with_its_own_pool() -> None:
    """The admin pool page's data: every live replica the ingress polled, from its own statistics (the
    ones the per-replica gauges are set from); a replica with no report yet is listed as such."""
    from api.cluster.remote_client import RemoteEngineClient
    from api.engine_protocol import encode
    from api.pool_view import replica_pools

    client = RemoteEngineClient(EngineConfig(model="."), "EngineReplica")
    stats = _stats(2, 10, 100, ["d1", "d2"], 3)
    stats.engine |= {"num_waiting": 4, "prefix_cache_queries": 200, "prefix_cache_hits": 50}
    stats.adapters[1]["tier"] = "cpu"
    client.replicas = [
        {"replica": "r2", "healthy": False, "stats": None},
        {"replica": "r1", "healthy": True, "stats": encode(stats)},
    ]
    one, two = replica_pools(client, {"d1": "support"})
    assert (one.replica, one.healthy, one.reported) == ("r1", True, True)
    assert (one.num_waiting, one.num_running, one.kv_blocks_total) == (4, 2, 100)
    assert one.prefix_hit_rate == 0.25 and one.lora == {"loads": 3, "pages_used": 1}
    assert [(a["label"], a["tier"], a["active_name"]) for a in one.adapters] == [
        ("support", "device", "support"),
        ("d2", "cpu", None),
    ]
    assert one.tier_counts == {"device": 1, "loading": 0, "cpu": 1, "disk": 0}
    assert (two.replica, two.healthy, two.reported, two.adapters) == ("r2", False, False, [])
    assert two.to_json()["prefix_hit_rate"] is None
