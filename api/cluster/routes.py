"""`GET /admin/api/cluster` (admin token): every engine replica as it reports itself, read now."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

from fastapi import APIRouter

from api.deps import AdminActor, StateDep
from api.engine_protocol import EngineStatsMsg, decode_from_engine
from api.errors import error_responses

if TYPE_CHECKING:
    from api.cluster.remote_client import RemoteEngineClient

log = logging.getLogger("loraplex.cluster")
router = APIRouter(prefix="/admin/api", tags=["admin"], responses=error_responses(401, 403, 503))


# what a prefill or decode replica adds to its report (api/cluster/disaggregated/app.py)
DISAGGREGATED_KEYS = (
    "role",
    "kv_exports",
    "kv_imports",
    "kv_timeouts",
    "prepared",
    "late_loads",
    "decode_adds",
)


@router.get("/cluster")
async def cluster_status(state: StateDep, _: AdminActor) -> dict:
    """Per replica: id, health, in-flight requests, the active adapters it follows (name → digest), when
    it last saw each name change (unix time), adapters made resident by its multiplexed loader, and its
    adapter pool (loads, residency by tier), its prefix cache's counters (prompt tokens looked up, hit); its
    engine's process id, its own cache dir (database blob
    store; null with local blobs), the directory each adapter was loaded from, its start-up phases, the
    prefix-cache blocks it reports to the router, the hot adapters it pins for the router, the Ray node
    it runs on and its placement group (tensor parallel: strategy, bundles, each bundle's node). Beside
    them, `deployment`: the engine replicas Serve aims at now and its autoscaling config (null with a
    fixed `--replicas`), as Serve's controller holds them (null when it did not answer). Disaggregated
    (`--prefill-replicas/--decode-replicas`): each replica's `role` and its KV-transfer counters."""
    client = cast("RemoteEngineClient", state.client)  # the ingress's client (this router is cluster-only)
    await client.poll()
    out = []
    for r in client.replicas:
        stats = cast(EngineStatsMsg, decode_from_engine(r["stats"])) if r["stats"] else None
        entry = {
            "replica": r["replica"],
            "healthy": r["healthy"],
            "restarts": r["restarts"],
            "in_flight": r["in_flight"],
            "active": r["active"],
            "changed_at": r.get("changed_at", {}),
            "multiplexed_loads": r["multiplexed_loads"],
            "lora": stats.lora if stats else None,
            "prefix_cache": {k: stats.engine.get(f"prefix_cache_{k}", 0) for k in ("queries", "hits")}
            if stats
            else None,
            "adapters": stats.adapters if stats else [],
            "engine_pid": r.get("engine_pid"),
            "data_dir": r.get("data_dir"),
            "loaded_paths": r.get("loaded_paths", {}),
            "startup_seconds": r.get("startup_seconds", {}),
            "prefix_blocks_held": r.get("prefix_blocks_held", 0),
            "pinned_hot": r.get("pinned_hot", []),
            "node_id": r.get("node_id"),
            "placement": r.get("placement"),
        }
        entry |= {k: r[k] for k in DISAGGREGATED_KEYS if k in r}  # a prefill or decode replica's own
        out.append(entry)
    return {"replicas": sorted(out, key=lambda r: r["replica"]), "deployment": await _deployment_scale()}


async def _deployment_scale() -> dict | None:
    """The engine deployment's target replicas and autoscaling config, from Serve's controller."""
    from api.cluster import ray_api
    from api.cluster.deployments import ENGINE_DEPLOYMENT

    try:
        return await asyncio.wait_for(asyncio.to_thread(ray_api.deployment_scale, ENGINE_DEPLOYMENT), 5.0)
    except Exception as exc:  # the controller is busy or restarting: the replicas' own reports still stand
        log.warning("Serve's controller did not report the engine deployment: %s", exc)
        return None
