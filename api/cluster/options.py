"""`ClusterOptions`: how `loraplex serve --replicas N` lays out its Ray Serve application."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTERS = ("affinity", "multiplex")
# the router weights' defaults, measured by `bench/cluster/router_sweep.py` (docs/benchmarks.md)
W_PREFIX, W_ADAPTER, W_LOAD = 1.0, 1.0, 1.0


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


# hot-adapter spreading (`SpreadPolicy`): the defaults measured by `bench/cluster/affinity.py`
SPREAD_LOAD, MAX_SPREAD, CONTRACT_AFTER_S = 0.5, 4, 10.0


@dataclass(frozen=True, slots=True)
class SpreadPolicy:
    """How far the affinity router spreads a hot adapter (settings `router_spread_load`,
    `router_max_spread`, `router_contract_after`): an adapter stays on one replica until its own load
    there (its in-flight tokens over the replica's KV budget, or its in-flight requests over the replica's
    `max_num_seqs`, whichever is higher) reaches `load` on every replica it is on; then it spreads to one
    more, up to `max_replicas`. It contracts by one when, for `contract_after_s` seconds, its load would
    stay under half of `load` on one replica fewer."""

    load: float = SPREAD_LOAD
    max_replicas: int = MAX_SPREAD
    contract_after_s: float = CONTRACT_AFTER_S

    def validate(self) -> None:
        """Raise ValueError for a policy that cannot work."""
        if self.load <= 0:
            raise ValueError("--router-spread-load must be positive")
        if self.max_replicas < 1:
            raise ValueError("--router-max-spread must be at least 1")
        if self.contract_after_s < 0:
            raise ValueError("--router-contract-after cannot be negative")


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
    spread: SpreadPolicy = field(default_factory=SpreadPolicy)

    def validate(self) -> None:
        """Raise ValueError for a layout Ray would refuse or could never place."""
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.ingress_replicas < 1:
            raise ValueError("--ingress-replicas must be at least 1")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("--cpus-per-replica and --gpus-per-replica cannot be negative")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        self.router_weights.validate()
        self.spread.validate()
