"""The Ray Serve application: an ingress deployment and an engine deployment with N replicas.

`build_application(settings, replicas)` returns the bound app for `ray_api.run`. The ingress runs the same
FastAPI app as `loraplex serve` (`api.app.create_app`), with a `RemoteEngineClient` in place of the local
engine process. The engine deployment's multiplexed loader keeps up to `pool_capacity(config)` adapters
per replica (what its device pool holds). With `--router affinity` (the default) the deployment's request
router is `AffinityRouter` (prefix, adapter residency and load; each replica reports its adapters by tier
in `record_routing_stats`); with `--router multiplex` Ray routes each adapter's requests to a replica whose
multiplexed LRU holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.cluster import ray_api
from api.cluster.options import ClusterOptions
from api.cluster.replica_resources import replica_resources
from api.settings import ServerSettings
from engine.engine_config import EngineConfig
from kernels.intmath import cdiv

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
# Past the shutdown grace: time for the requests cut at its end to write their 503s and close.
CUT_MARGIN_SECONDS = 5.0
HEALTH_CHECK_PERIOD_S = 1.0  # a replica whose engine died is found within a few periods

_ingress_apps: list[Any] = []  # the FastAPI app of this process's ingress replica (set when it is built)


def pool_capacity(config: EngineConfig) -> int:
    """Adapters of the largest allowed rank that fit in the device pool at once (the multiplexing LRU's
    size, instead of Ray's default of 3)."""
    per_adapter = cdiv(config.max_lora_rank, config.lora_page_rank)
    return max(1, config.adapter_pool_pages() // per_adapter)


def engine_deployment(
    settings: ServerSettings, options: ClusterOptions, max_ongoing: int | None = None
) -> Any:
    """The engine deployment class (one `EngineReplica` per Serve replica), each replica asking Ray for
    `options.cpus_per_replica` CPUs and `options.gpus_per_replica` GPUs (at `--tensor-parallel-size N`:
    a placement group of its N ranks on one node, `replica_resources`); `options.replicas` of them, or,
    with `--max-replicas`, as many as Serve's autoscaling asks for (target ongoing requests per replica:
    `--target-ongoing-requests`, default the engine's `max_num_seqs`). `max_ongoing` requests per
    replica (default: the engine's `max_num_seqs`): past it, Ray sends an adapter's requests to another
    replica even though that one must load the adapter (load balance over affinity)."""
    from api.cluster.replica import EngineReplica, LoadedAdapter

    class EngineDeployment:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray Serve awaits an async constructor
            ray_api.log_to_stderr()
            self.replica = EngineReplica(settings, ray_api.replica_id(), pool_capacity(settings.engine))
            self.replica.node_id, self.replica.placement = ray_api.node_id(), ray_api.placement()
            await self.replica.start()

        @ray_api.multiplexed(pool_capacity(settings.engine))
        async def adapter(self, digest: str) -> LoadedAdapter:
            loaded = await self.replica.prefetch(digest)
            self.replica.multiplexed_loads += 1
            return loaded

        async def generate(self, payload: bytes, hot: dict[str, list[str]] | None = None):
            digest = ray_api.multiplexed_model_id()
            adapter = None
            if digest:
                try:
                    adapter = await self.adapter(digest)
                except LookupError:
                    adapter = None  # refused by `EngineReplica.generate` with its reason
            async for item in self.replica.generate(payload, adapter, hot):
                yield item

        def describe(self) -> dict[str, Any]:
            return self.replica.describe()

        async def record_routing_stats(self) -> dict[str, Any]:  # on the replica's loop (not a thread)
            return self.replica.routing_stats(pool_capacity(settings.engine))

        def check_health(self) -> None:
            self.replica.check_health()

        async def __del__(self) -> None:
            await self.replica.stop()

    extra: dict[str, Any] = {}
    if options.router == "affinity":
        w, spread = options.router_weights, options.spread
        kwargs = {"block_size": settings.engine.block_size, "w_prefix": w.prefix, "w_adapter": w.adapter}
        kwargs |= {"w_load": w.load, "spread_load": spread.load, "max_spread": spread.max_replicas}
        kwargs["contract_after_s"] = spread.contract_after_s
        extra["request_router_config"] = ray_api.affinity_router_config(kwargs)
    res = replica_resources(settings.engine, options.cpus_per_replica, options.gpus_per_replica)
    return ray_api.deployment(
        EngineDeployment,
        name=ENGINE_DEPLOYMENT,
        num_replicas=options.replicas,
        autoscaling_config=options.autoscaling_config(default_target=settings.engine.max_num_seqs),
        max_ongoing_requests=max_ongoing or max(8, settings.engine.max_num_seqs),
        num_cpus=res.cpus_per_rank,
        num_gpus=res.gpus,
        bundles=res.bundles(),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=10,
        graceful_shutdown_timeout_s=settings.shutdown_grace_seconds + 2 * CUT_MARGIN_SECONDS,
        **extra,
    )


def ingress_deployment(
    settings: ServerSettings,
    options: ClusterOptions,
    client_factory: Callable[[EngineConfig], Any] | None = None,
) -> Any:
    """The HTTP ingress (`options.ingress_replicas` replicas): `create_app` with a client that reaches the
    engine deployment through Ray (`client_factory`, default a `RemoteEngineClient`), plus `drain(grace)`
    and `in_flight()` for the driver's SIGTERM."""

    def build_app():
        from api.app import create_app
        from api.cluster.in_flight import InFlightMiddleware
        from api.cluster.remote_client import RemoteEngineClient
        from api.cluster.replica_header import ReplicaHeaderMiddleware
        from api.cluster.routes import router

        def make_client(cfg: EngineConfig) -> RemoteEngineClient:
            client = RemoteEngineClient(cfg, ENGINE_DEPLOYMENT, affinity=options.router == "multiplex")
            client.engine_replicas = options.replicas  # the ingress admits for all of them
            return client

        ray_api.log_to_stderr()
        app = create_app(settings, client_factory=client_factory or make_client)
        app.include_router(router)
        app.add_middleware(ReplicaHeaderMiddleware)
        app.add_middleware(InFlightMiddleware)
        remember_ingress_app(app)
        return app

    class IngressDeployment:
        def __init__(self, engine: Any = None, *more: Any) -> None:
            self.engine = (engine, *more)  # bound so that Serve deploys the engine(s) with the ingress

        async def drain(self, grace: float) -> int:
            """Refuse new requests with 503 from now on; end those still running after `grace` seconds
            (503, or an SSE error event). Returns the requests in flight now."""
            import asyncio

            from api.cluster.in_flight import http_in_flight

            client = _ingress_client()
            if client is not None:
                client.begin_drain()
                asyncio.get_running_loop().call_later(grace, client.end_in_flight)
            return http_in_flight()

        async def in_flight(self) -> int:
            """HTTP requests this ingress replica is serving now."""
            from api.cluster.in_flight import http_in_flight

            return http_in_flight()

    return ray_api.deployment(
        ray_api.ingress(build_app)(IngressDeployment),
        name=INGRESS_DEPLOYMENT,
        num_replicas=options.ingress_replicas,
        max_ongoing_requests=1000,
        on_head=True,  # beside Serve's proxy (head node only): losing a worker node keeps the front end
        graceful_shutdown_timeout_s=settings.shutdown_grace_seconds + CUT_MARGIN_SECONDS,
    )


def remember_ingress_app(app: Any) -> None:
    """Keep this process's ingress app for `drain` (module-level, so that the deployment's methods, which
    Ray pickles by value, and `build_app` reach the same list through this imported module)."""
    _ingress_apps[:] = [app]


def _ingress_client() -> Any:
    """The engine client of this process's ingress app, once its lifespan has started it."""
    state = getattr(_ingress_apps[0].state, "loraplex", None) if _ingress_apps else None
    return state.client if state is not None else None


def build_application(settings: ServerSettings, options: ClusterOptions) -> Any:
    """The bound application: the ingress, with the engine deployment as its dependency (with
    `--prefill-replicas/--decode-replicas`: api/cluster/disaggregated/app.py)."""
    if options.disaggregated:
        from api.cluster.disaggregated.app import build_disaggregated_application

        return build_disaggregated_application(settings, options)
    engine = engine_deployment(settings, options).bind()
    return ingress_deployment(settings, options).bind(engine)
