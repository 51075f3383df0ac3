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
    """Join the Ray cluster at `address`, or start a small local one (no dashboard, small object store)."""
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
        ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store_bytes, **common)


def start_http(host: str, port: int) -> None:
    """Start Serve with its HTTP proxy on `host:port` (one proxy, on the head node)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")


def run(app: Any, route_prefix: str | None = "/") -> Any:
    """Deploy the bound application and return its ingress handle once every replica is up."""
    from ray import serve

    return serve.run(app, name=APP_NAME, route_prefix=route_prefix, blocking=False)


def shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


# ---- deployments ---------------------------------------------------------------------------------
def deployment(cls: type, *, name: str, num_replicas: int, max_ongoing_requests: int, **options: Any) -> Any:
    """`cls` as a Serve deployment; replicas take no Ray CPU slot (engines pin their own threads)."""
    from ray import serve

    return serve.deployment(
        name=name,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
        **options,
    )(cls)


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


async def broadcast(handle: Any, method: str, timeout_s: float) -> list[Any]:
    """`method()` on every live replica; a failed replica's entry is its exception."""
    return await handle.broadcast(method).results_async(timeout_s=timeout_s, return_exceptions=True)


def is_replica_failure(exc: BaseException) -> bool:
    """True when `exc` says the replica (its actor) died or became unreachable, not that its code failed."""
    import ray.exceptions as rex

    return isinstance(exc, rex.RayActorError | rex.WorkerCrashedError | rex.NodeDiedError) and not isinstance(
        exc, rex.RayTaskError
    )


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
