"""`ClusterOptions`: how `loraplex serve --replicas N` lays out its Ray Serve application."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTERS = ("affinity", "multiplex")
W_PREFIX, W_ADAPTER, W_LOAD = 1.0, 1.0, 2.0  # the router weights' defaults


@dataclass(frozen=True, slots=True)
class RouterWeights:
    """The score's weights (settings `router_w_prefix`, `router_w_adapter`, `router_w_load`)."""

    prefix: float = W_PREFIX
    adapter: float = W_ADAPTER
    load: float = W_LOAD

    def validate(self) -> None:
        """Raise ValueError for a negative weight."""
        if min(self.prefix, self.adapter, self.load) < 0:
            raise ValueError("router weights cannot be negative")


@dataclass(slots=True)
class ClusterOptions:
    replicas: int
    ray_address: str | None = None  # None: start a local Ray cluster (never join one by accident)
    num_cpus: int | None = None  # CPUs of a local cluster (None: Ray's count)
    cpus_per_replica: float = 0  # Ray CPUs each engine replica reserves (0: engines pin their own threads)
    gpus_per_replica: float = 0  # Ray GPUs each engine replica reserves (1: one device per replica)
    ingress_replicas: int = 1  # HTTP ingress replicas (each a FastAPI app that routes to the engines)
    # "affinity": `AffinityRouter` scores prefix, adapter residency and load; "multiplex": Serve's
    # multiplexing by adapter digest (the adapter only)
    router: str = "affinity"
    router_weights: RouterWeights = field(default_factory=RouterWeights)
    # prefill/decode disaggregation (`--prefill-replicas P --decode-replicas D`, instead of `replicas`)
    prefill_replicas: int = 0
    decode_replicas: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0 or self.decode_replicas > 0

    def validate(self) -> None:
        """Raise ValueError for a layout Ray would refuse or could never place."""
        if self.disaggregated:
            if self.prefill_replicas < 1 or self.decode_replicas < 1:
                raise ValueError("--prefill-replicas and --decode-replicas go together, each at least 1")
            if self.replicas:
                raise ValueError("--replicas (colocated) or --prefill-replicas/--decode-replicas, not both")
        elif self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.ingress_replicas < 1:
            raise ValueError("--ingress-replicas must be at least 1")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("--cpus-per-replica and --gpus-per-replica cannot be negative")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        self.router_weights.validate()
