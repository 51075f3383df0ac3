"""The disaggregated Serve application: the ingress, a prefill deployment and a decode deployment.

`build_disaggregated_application(settings, options)`: `options.prefill_replicas` PrefillReplicas routed
by `AffinityRouter` (prefix, adapter residency, load), `options.decode_replicas` DecodeReplicas routed by
`DecodeRouter` (adapter residency, free KV blocks, load), and the ingress (`api.cluster.deployments`)
with a `DisaggregatedClient`.
"""

from __future__ import annotations

from typing import Any

from api.cluster import ray_api
from api.cluster.deployments import (
    CUT_MARGIN_SECONDS,
    HEALTH_CHECK_PERIOD_S,
    ingress_deployment,
    pool_capacity,
)
from api.cluster.options import ClusterOptions
from api.settings import ServerSettings
from engine.engine_config import EngineConfig

PREFILL_DEPLOYMENT = "PrefillReplica"
DECODE_DEPLOYMENT = "DecodeReplica"


def _common(settings: ServerSettings, options: ClusterOptions) -> dict[str, Any]:
    return dict(
        max_ongoing_requests=max(8, settings.engine.max_num_seqs),
        num_cpus=options.cpus_per_replica,
        num_gpus=options.gpus_per_replica,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=10,
        graceful_shutdown_timeout_s=settings.shutdown_grace_seconds + 2 * CUT_MARGIN_SECONDS,
    )


def prefill_deployment(settings: ServerSettings, options: ClusterOptions) -> Any:
    from api.cluster.disaggregated.replicas import PrefillWorker
    from api.cluster.replica import EngineReplica

    class PrefillDeployment:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray Serve awaits an async constructor
            ray_api.log_to_stderr()
            self.replica = EngineReplica(settings, ray_api.replica_id())
            self.worker = PrefillWorker(self.replica, options.kv_transfer_timeout_s)
            await self.replica.start()

        async def generate(self, payload: bytes):
            async for item in self.worker.generate(payload):
                yield item

        def release_handoff(self, key: str) -> bool:
            return self.worker.release(key)

        def describe(self) -> dict[str, Any]:
            return self.replica.describe() | {
                "role": "prefill",
                "kv_exports": self.worker.exports,
                "kv_held": len(self.worker.held),
            }

        def record_routing_stats(self) -> dict[str, Any]:
            return self.replica.routing_stats(pool_capacity(settings.engine))

        def check_health(self) -> None:
            self.replica.check_health()

        async def __del__(self) -> None:
            await self.replica.stop()

    w = options.router_weights
    kwargs = {"block_size": settings.engine.block_size, "w_prefix": w.prefix, "w_adapter": w.adapter}
    router = ray_api.affinity_router_config({**kwargs, "w_load": w.load})
    return ray_api.deployment(
        PrefillDeployment,
        name=PREFILL_DEPLOYMENT,
        num_replicas=options.prefill_replicas,
        request_router_config=router,
        **_common(settings, options),
    )


def decode_deployment(settings: ServerSettings, options: ClusterOptions) -> Any:
    from api.cluster.disaggregated.replicas import DecodeWorker
    from api.cluster.replica import EngineReplica

    class DecodeDeployment:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray Serve awaits an async constructor
            ray_api.log_to_stderr()
            self.replica = EngineReplica(settings, ray_api.replica_id())
            self.worker = DecodeWorker(self.replica, options.kv_transfer_timeout_s, options.kv_staging)
            await self.replica.start()

        async def prepare(self, digest: str, name: str, members: list | None = None) -> dict[str, Any]:
            return await self.worker.prepare(digest or None, name or None, members)

        async def generate(self, digest: str, payload: bytes):
            """A whole request here, prefill included (a short prompt: `local_prefill_tokens`)."""
            async for item in self.replica.generate(payload, None):
                yield item

        async def decode(self, target: str, handoff: Any, digest: str = ""):
            async for item in self.worker.decode(handoff):
                yield item

        def describe(self) -> dict[str, Any]:
            w = self.worker
            return self.replica.describe() | {
                "role": "decode",
                "kv_imports": w.imports,
                "kv_timeouts": w.timeouts,
                "prepared": w.prepared,
                "late_loads": w.late_loads,
                "decode_adds": w.decode_adds,
            }

        def record_routing_stats(self) -> dict[str, Any]:
            return self.worker.routing_stats(pool_capacity(settings.engine))

        def check_health(self) -> None:
            self.replica.check_health()

        async def __del__(self) -> None:
            await self.replica.stop()

    router = ray_api.router_config(
        "api.cluster.disaggregated.decode_router.DecodeRouter", {"max_seqs": settings.engine.max_num_seqs}
    )
    return ray_api.deployment(
        DecodeDeployment,
        name=DECODE_DEPLOYMENT,
        num_replicas=options.decode_replicas,
        request_router_config=router,
        **_common(settings, options),
    )


def build_disaggregated_application(settings: ServerSettings, options: ClusterOptions) -> Any:
    """The bound application: the ingress, with the prefill and decode deployments as its dependencies."""
    from api.cluster.disaggregated.client import DisaggregatedClient

    def make_client(cfg: EngineConfig) -> DisaggregatedClient:
        return DisaggregatedClient(
            cfg,
            PREFILL_DEPLOYMENT,
            DECODE_DEPLOYMENT,
            options.kv_transfer_timeout_s,
            local_prefill_tokens=options.local_prefill_tokens,
        )

    prefill = prefill_deployment(settings, options).bind()
    decode = decode_deployment(settings, options).bind()
    return ingress_deployment(settings, options, make_client).bind(prefill, decode)
