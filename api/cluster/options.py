"""`ClusterOptions`: how `loraplex serve --replicas N` lays out its Ray Serve application."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ClusterOptions:
    replicas: int
    ray_address: str | None = None  # None: start a local Ray cluster (never join one by accident)
    num_cpus: int | None = None  # CPUs of a local cluster (None: Ray's count)
    cpus_per_replica: float = 0  # Ray CPUs each engine replica reserves (0: engines pin their own threads)
    gpus_per_replica: float = 0  # Ray GPUs each engine replica reserves (1: one device per replica)
    ingress_replicas: int = 1  # HTTP ingress replicas (each a FastAPI app that routes to the engines)

    def validate(self) -> None:
        """Raise ValueError for a layout Ray would refuse or could never place."""
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.ingress_replicas < 1:
            raise ValueError("--ingress-replicas must be at least 1")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("--cpus-per-replica and --gpus-per-replica cannot be negative")
