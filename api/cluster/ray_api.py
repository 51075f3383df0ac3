"""Every Ray and Ray Serve call loraplex makes, in one small module.

Ray Serve's multiplexing API is beta (there is a proposal to rename it), so the rest of `api.cluster`
names these wrappers instead: a rename is a change here only. Ray is an optional extra
(`pip install -e .[ray]`); `require_ray()` turns its absence into a clear message.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable
from typing import Any

APP_NAME = "loraplex"
NAMESPACE = "loraplex"
HEAD_NODE_RESOURCE = "node:__internal_head__"

# Serve's router gives a replica 0.1 s to report its queue length; a replica that misses it counts as
# busy and the request falls back to the replica with the fewest models, which must then load the
# adapter. Engine replicas share their machine with an engine process, so give them longer.
ROUTER_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "0.5"}


class RayMissing(RuntimeError):
    """Ray Serve is not installed."""


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise RayMissing("--replicas needs Ray Serve: pip install -e '.[ray]'") from exc


# ---- the cluster ---------------------------------------------------------------------------------
def init(address: str | None, num_cpus: int | None, object_store_bytes: int = 100 * 1024**2) -> None:
    """Join the Ray cluster at `address`, or start a small local one (no dashboard, small object store).

    Without `address` the cluster is always a new local one: `RAY_ADDRESS` and the address file of an
    earlier `ray start` (which a plain `ray.init()` would join, and hang on when it is dead) are ignored,
    and `RAY_ADDRESS` is removed from this process's environment so that no child process joins it."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for key, value in ROUTER_ENV.items():  # this process routes too (handles created by the driver)
        os.environ.setdefault(key, value)
    common: dict[str, Any] = dict(
        namespace=NAMESPACE,
        ignore_reinit_error=True,
        log_to_driver=False,
        runtime_env={"env_vars": ROUTER_ENV},
    )
    if address:
        ray.init(address=address, **common)
    else:
        os.environ.pop("RAY_ADDRESS", None)
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=object_store_bytes,
            **common,
        )


def gcs_address() -> str:
    """The address of the cluster this process is connected to (host:port of its GCS)."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def alive_nodes() -> list[dict[str, float]]:
    """The total resources of each alive node of the cluster (`{"CPU": 2.0, "GPU": 1.0, ...}`)."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def node_id() -> str:
    """The id of the Ray node this process runs on (hex)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def placement() -> dict[str, Any] | None:
    """The placement group this actor runs in: its strategy, bundles and the node of each bundle (None
    outside one)."""
    from ray.util.placement_group import get_current_placement_group, placement_group_table

    group = get_current_placement_group()
    if group is None:
        return None
    table = placement_group_table(group)
    order = sorted(table["bundles"])
    return {
        "strategy": table["strategy"],
        "bundles": [dict(table["bundles"][i]) for i in order],
        "nodes": [table["bundles_to_node_id"].get(i) for i in order],
    }


def start_http(host: str, port: int) -> None:
    """Start Serve with its HTTP proxy on `host:port` (one proxy, on the head node)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")


def run(app: Any, route_prefix: str | None = "/") -> Any:
    """Deploy the bound application and return its ingress handle once every replica is up."""
    from ray import serve

    return serve.run(app, name=APP_NAME, route_prefix=route_prefix, blocking=False)


def delete_app() -> None:
    """Remove loraplex's own Serve application (its replicas drain for their graceful shutdown timeout);
    other applications on the cluster are left alone."""
    from ray import serve

    serve.delete(APP_NAME)


def app_names() -> list[str]:
    """Names of the Serve applications on the cluster."""
    from ray import serve

    return sorted(serve.status().applications)


def shutdown(own_cluster: bool = True, remove_app: bool = True) -> None:
    """Leave the cluster. On a cluster of our own (local), stop Serve and Ray; on one given by
    `--ray-address` remove only loraplex's application (unless `remove_app` is False: this process
    deployed nothing, and the application there is another driver's) and disconnect: Serve, its proxies
    and every other application keep running."""
    import ray
    from ray import serve

    try:
        if own_cluster:
            serve.shutdown()
        elif remove_app:
            delete_app()
    finally:
        ray.shutdown()


def log_to_stderr(level: int = 20) -> None:
    """In a replica process: send loraplex's log records (`loraplex.*`, INFO and up by default) to the
    process's stderr, which Ray keeps in the session's `logs/worker-*.err` (and shows with `ray logs`)."""
    import logging
    import sys

    class ReplicaLogHandler(logging.StreamHandler):
        pass

    logger = logging.getLogger("loraplex")
    logger.setLevel(level)
    if not any(type(h).__name__ == "ReplicaLogHandler" for h in logger.handlers):
        handler = ReplicaLogHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


# ---- deployments ---------------------------------------------------------------------------------
def deployment(
    cls: type,
    *,
    name: str,
    num_replicas: int,
    max_ongoing_requests: int,
    num_cpus: float = 0,
    num_gpus: float = 0,
    bundles: list[dict[str, float]] | None = None,
    on_head: bool = False,
    autoscaling_config: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """`cls` as a Serve deployment whose every replica asks Ray for `num_cpus` CPUs and `num_gpus` GPUs
    (default none: engines pin their own threads; Ray then places replicas without counting them).
    With `bundles`, each replica reserves a placement group of them, all on one node (`STRICT_PACK`);
    its actor runs in (and takes its CPUs and GPUs from) the first. `on_head`: replicas run on the head
    node only. With `autoscaling_config` (Serve's: min/initial/max replicas, target ongoing requests)
    Serve scales the replicas and `num_replicas` is not passed (Serve refuses both)."""
    from ray import serve

    actor_options: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        actor_options["num_gpus"] = num_gpus
    if on_head:  # Ray's marker resource of the head node (as Ray's own libraries pin actors there)
        actor_options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    if bundles:
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = "STRICT_PACK"
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    return serve.deployment(
        name=name,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=actor_options,
        **options,
    )(cls)


def affinity_router_config(kwargs: dict[str, Any], stats_period_s: float = 1.0) -> Any:
    """Serve's `RequestRouterConfig` for `api.cluster.affinity_router.AffinityRouter` with `kwargs`
    (its `initialize_state` arguments); replicas report `record_routing_stats` every `stats_period_s`."""
    from ray.serve.config import RequestRouterConfig

    config: dict[str, Any] = {
        "request_router_class": "api.cluster.affinity_router.AffinityRouter",
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": 5.0,
    }
    return RequestRouterConfig(**config)


def ingress(build_app: Callable[[], Any]) -> Callable[[type], type]:
    """Class decorator: the deployment serves the ASGI app `build_app()` builds on each replica."""
    from ray import serve

    return serve.ingress(build_app)


def multiplexed(max_models: int) -> Callable:
    """Method decorator for the per-replica LRU of multiplexed models (loader `async def f(self, id)`)."""
    from ray import serve

    return serve.multiplexed(max_num_models_per_replica=max_models)


def multiplexed_model_id() -> str:
    """The multiplexed model id of the request being served ("" when the caller gave none)."""
    from ray import serve

    return serve.get_multiplexed_model_id()


def replica_id() -> str:
    """This replica's id within its deployment (unique while it lives; a restarted replica gets a new one)."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def deployment_scale(deployment_name: str) -> dict[str, Any]:
    """What Serve's controller holds for `deployment_name` in the loraplex app: the replicas it aims at
    now (`target_replicas`; it moves with autoscaling) and its `autoscaling` config (None: a fixed
    count). Read from the controller's instance details (what `serve status` shows), through Serve's
    internal client: Serve has no public call for one deployment's config."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise RuntimeError("Serve is not running")
    dep = client.get_serve_details()["applications"][APP_NAME]["deployments"][deployment_name]
    config = dep.get("deployment_config") or {}
    scaling = config.get("autoscaling_config")
    return {"target_replicas": dep.get("target_num_replicas"), "autoscaling": scaling}


def deployment_handle(deployment_name: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment_name, app_name=APP_NAME)


# ---- calls ---------------------------------------------------------------------------------------
def stream(handle: Any, method: str, model_id: str | None, *args: Any) -> Any:
    """A streaming call of `method`; with `model_id`, routed to a replica that holds that model."""
    opts: dict[str, Any] = {"stream": True}
    if model_id:
        opts["multiplexed_model_id"] = model_id
    return getattr(handle.options(**opts), method).remote(*args)


async def iterate(response: Any) -> AsyncGenerator[Any, None]:
    """The items of a streaming call; leaving early cancels it on the replica."""
    done = False
    try:
        async for item in response:
            yield item
        done = True
    finally:
        if not done:
            response.cancel()


async def call(handle: Any, method: str, *args: Any) -> Any:
    return await getattr(handle, method).remote(*args)


async def broadcast(handle: Any, method: str, timeout_s: float, *args: Any) -> list[Any]:
    """`method(*args)` on every live replica; a failed replica's entry is its exception."""
    return await handle.broadcast(method, *args).results_async(timeout_s=timeout_s, return_exceptions=True)


def broadcast_sync(handle: Any, method: str, timeout_s: float, *args: Any) -> list[Any]:
    """`method(*args)` on every live replica, from outside an event loop (the driver)."""
    return handle.broadcast(method, *args).results(timeout_s=timeout_s, return_exceptions=True)


def is_initialized() -> bool:
    import ray

    return bool(ray.is_initialized())


def is_replica_failure(exc: BaseException) -> bool:
    """True when `exc` says the replica (its actor) died or became unreachable, not that its code failed."""
    import ray.exceptions as rex
    from ray.serve.exceptions import ReplicaUnavailableError

    dead = rex.RayActorError | rex.WorkerCrashedError | rex.NodeDiedError | ReplicaUnavailableError
    return isinstance(exc, dead) and not isinstance(exc, rex.RayTaskError)


def is_deployment_unavailable(exc: BaseException) -> bool:
    """True when `exc` says the deployment has no replica running yet (or any more): its replicas are
    still starting, or all of them are being replaced."""
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(exc, DeploymentUnavailableError)


# ---- for tests and operators ---------------------------------------------------------------------
def replica_actor_names(deployment_name: str) -> list[str]:
    """Names of the live replica actors of `deployment_name` in the loraplex app."""
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment_name}#"
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    )


def kill_actor(name: str) -> None:
    """Kill a Serve replica actor (Serve notices and starts a replacement)."""
    import ray

    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


# ---- prefill/decode disaggregation (api/cluster/disaggregated/) -----------------------------------
def put(value: Any) -> Any:
    """Store `value` in Ray's object store (this process owns it); returns its ObjectRef."""
    import ray

    return ray.put(value)


async def get(refs: list[Any], timeout_s: float) -> list[Any]:
    """The values of `refs`, fetched from the object store (zero-copy on one node); `TimeoutError` when
    they do not all arrive within `timeout_s`, `TransferFailed` when they are lost (their owner died)."""
    import asyncio

    import ray.exceptions as rex

    try:
        return list(await asyncio.wait_for(asyncio.gather(*refs), timeout_s))
    except (rex.ObjectLostError, rex.OwnerDiedError, rex.ObjectFetchTimedOutError, rex.RayActorError) as exc:
        raise TransferFailed(str(exc)) from exc


class TransferFailed(RuntimeError):
    """Objects of a KV transfer could not be fetched (their owner, the prefill replica, died)."""


def router_config(router_class: str, kwargs: dict[str, Any], stats_period_s: float = 1.0) -> Any:
    """Serve's `RequestRouterConfig` for the request router at import path `router_class`."""
    from ray.serve.config import RequestRouterConfig

    config: dict[str, Any] = {
        "request_router_class": router_class,
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": 5.0,
    }
    return RequestRouterConfig(**config)
