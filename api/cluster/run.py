"""`loraplex serve --replicas N`: start (or join) a Ray cluster, deploy the app, serve until a signal.

Start-up is logged per phase (`loraplex.cluster`): Ray, Serve's HTTP proxy, the deployment (the engine
replicas loading their model; each replica logs its own phases too). On SIGTERM/SIGINT the ingress
replicas drain with `settings.shutdown_grace_seconds` (new requests 503, requests still running at the
end of the grace 503 or an SSE error event, as with the single server), then only loraplex's own Serve
application is removed; Serve and Ray are stopped only on a local cluster this process started.
Before deploying, `check_cluster` refuses (one line, nothing deployed) a layout the alive nodes cannot
hold and a cluster that already runs another driver's loraplex application.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from api.cluster import ray_api
from api.cluster.options import ClusterOptions
from api.settings import ServerSettings
from lora_registry import open_registry

log = logging.getLogger("loraplex.cluster")

__all__ = ["ClusterOptions", "ClusterRefused", "drain", "serve_cluster", "start_cluster", "stop_cluster"]


class ClusterRefused(ValueError):
    """The cluster cannot take this deployment (its nodes cannot hold the replicas, or another driver's
    loraplex application is running there); nothing was deployed."""


def check_cluster(settings: ServerSettings, options: ClusterOptions) -> None:
    """ClusterRefused (one line) when, on the connected cluster, the alive nodes cannot hold the engine
    replicas to start with (unless `options.wait_for_nodes`), or a loraplex application already runs on
    a cluster given by `--ray-address` (one per cluster: deploying would replace another driver's)."""
    from api.cluster.replica_resources import fit_error, replica_resources

    if not (options.wait_for_nodes or options.disaggregated):
        res = replica_resources(settings.engine, options.cpus_per_replica, options.gpus_per_replica)
        error = fit_error(res, ray_api.alive_nodes(), options.replicas)
        if error is not None:
            raise ClusterRefused(error)
    if options.ray_address and ray_api.APP_NAME in ray_api.app_names():
        raise ClusterRefused(
            f"a loraplex application is already running on the Ray cluster at {options.ray_address} "
            "(one per cluster): stop its driver first, or remove it if the driver is gone (docs/deploy.md, "
            "section 2)"
        )


def start_cluster(
    settings: ServerSettings, options: ClusterOptions, on_connected: Callable[[], None] | None = None
) -> dict[str, float]:
    """Deploy the ingress and `options.replicas` engine replicas; returns once all are up, with the
    seconds each start-up phase took (also logged). `on_connected()` runs once Ray is up (which installs
    signal handlers of its own), before the deployment."""
    from api.cluster.deployments import build_application

    options.validate()
    ray_api.require_ray()
    assert settings.registry is not None
    if not settings.registry.redis_url:  # no events between processes: re-read the registry every second
        settings.registry_resync_seconds = min(settings.registry_resync_seconds, 1.0)
    t0 = time.monotonic()
    open_registry(settings.registry).close()  # create or upgrade the default SQLite schema once, up front
    t1 = time.monotonic()
    ray_api.init(options.ray_address, options.num_cpus)
    if on_connected is not None:
        on_connected()
    check_cluster(settings, options)
    t2 = time.monotonic()
    ray_api.start_http(settings.host, settings.port)
    t3 = time.monotonic()
    ray_api.run(build_application(settings, options))
    t4 = time.monotonic()
    phases = {"registry": t1 - t0, "ray": t2 - t1, "serve": t3 - t2, "deploy": t4 - t3, "total": t4 - t0}
    log.info(
        "cluster ready in %.1f s: registry %.1f s, ray %s %.1f s (%s), serve proxy %.1f s, "
        "%d engine replica(s) + %d ingress %.1f s",
        phases["total"], phases["registry"], "joined" if options.ray_address else "started local",
        phases["ray"], ray_api.gcs_address(), phases["serve"], options.replicas, options.ingress_replicas,
        phases["deploy"],
    )  # fmt: skip
    return phases


def drain(grace: float, margin: float = 5.0) -> int:
    """Drain the ingress replicas: new requests 503 from now on, requests still running after `grace`
    seconds end with 503 (or an SSE error event). Returns once none is in flight, or `grace + margin`
    seconds have passed; the return value is the number in flight when the drain began."""
    from api.cluster.deployments import INGRESS_DEPLOYMENT

    handle = ray_api.deployment_handle(INGRESS_DEPLOYMENT)
    started = time.monotonic()
    counts = ray_api.broadcast_sync(handle, "drain", 10.0, grace)
    at_start = sum(c for c in counts if isinstance(c, int))
    log.info("draining: %d request(s) in flight, grace %g s", at_start, grace)
    while time.monotonic() - started < grace + margin:
        left = ray_api.broadcast_sync(handle, "in_flight", 5.0)
        if sum(c for c in left if isinstance(c, int)) == 0:
            break
        time.sleep(0.1)
    log.info("drained in %.1f s", time.monotonic() - started)
    return at_start


def stop_cluster(options: ClusterOptions, deployed: bool = True) -> None:
    """Remove loraplex's application (if this process `deployed` it); on a local cluster of our own, stop
    Serve and Ray too."""
    ray_api.shutdown(own_cluster=options.ray_address is None, remove_app=deployed)


def serve_cluster(
    settings: ServerSettings, options: ClusterOptions, on_serving: Callable[[], None] | None = None
) -> None:
    """Serve until SIGINT/SIGTERM, then drain (see the module doc) and tear down what is ours;
    `on_serving()` runs once every deployment is up."""
    stop = threading.Event()
    started = refused = False

    def on_signals() -> None:  # after ray.init, which installs handlers of its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    try:
        start_cluster(settings, options, on_connected=on_signals)  # a signal meanwhile: drain once up
        started = True
        if on_serving is not None:
            on_serving()
        stop.wait()
        drain(settings.shutdown_grace_seconds)
    except ClusterRefused:
        refused = True  # nothing of ours there: an application on the cluster is another driver's
        raise
    finally:
        if started or ray_api.is_initialized():
            stop_cluster(options, deployed=not refused)
