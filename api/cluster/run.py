"""`loraplex serve --replicas N`: start (or join) a Ray cluster, deploy the app, serve until a signal."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from api.cluster import ray_api
from api.settings import ServerSettings
from lora_registry import open_registry


@dataclass(slots=True)
class ClusterOptions:
    replicas: int
    ray_address: str | None = None  # None: start a local Ray cluster
    num_cpus: int | None = None  # CPUs of a local cluster (None: Ray's count); replicas reserve none


def start_cluster(settings: ServerSettings, options: ClusterOptions) -> None:
    """Deploy the ingress and `options.replicas` engine replicas; returns once all are up."""
    from api.cluster.deployments import build_application

    if options.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    ray_api.require_ray()
    assert settings.registry is not None
    if not settings.registry.redis_url:  # no events between processes: re-read the registry every second
        settings.registry_resync_seconds = min(settings.registry_resync_seconds, 1.0)
    open_registry(settings.registry).close()  # create or upgrade the default SQLite schema once, up front
    ray_api.init(options.ray_address, options.num_cpus)
    ray_api.start_http(settings.host, settings.port)
    ray_api.run(build_application(settings, options.replicas))


def serve_cluster(
    settings: ServerSettings, options: ClusterOptions, on_serving: Callable[[], None] | None = None
) -> None:
    """Serve until SIGINT/SIGTERM, then tear the application (and a local Ray cluster) down;
    `on_serving()` runs once every deployment is up."""
    stop = threading.Event()
    try:
        start_cluster(settings, options)
        if on_serving is not None:
            on_serving()
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        ray_api.shutdown()
