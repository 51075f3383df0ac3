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


# Serve's queue in front of the engine replicas under `--router affinity`: `max_ongoing_requests` of the
# engine deployment is QUEUE_FACTOR × max_num_seqs (the replicas' own waiting queues hold the backlog,
# which the router's load term sees), and a request is offered only to the replicas whose score is within
# HOLD_MARGIN of the best one (Serve holds it for them while they are full); measured by
# `bench/cluster/router_sweep.py --serve` and `loraplex bench cluster` (docs/benchmarks.md)
QUEUE_FACTOR, HOLD_MARGIN = 8, 1.0


@dataclass(frozen=True, slots=True)
class RouterQueue:
    """Where the backlog waits under `--router affinity` (settings `router_max_ongoing`,
    `router_hold_margin`): `max_ongoing` requests per engine replica before Serve keeps the rest in its
    own queue (None: `QUEUE_FACTOR` × the engine's `max_num_seqs`); a request is offered to a replica
    only while that replica's score is at most `hold_margin` below the best replica's."""

    max_ongoing: int | None = None
    hold_margin: float = HOLD_MARGIN

    def max_ongoing_for(self, max_num_seqs: int) -> int:
        """The engine deployment's `max_ongoing_requests`."""
        return self.max_ongoing or QUEUE_FACTOR * max(1, max_num_seqs)

    def validate(self) -> None:
        """Raise ValueError for a queue that cannot work."""
        if self.max_ongoing is not None and self.max_ongoing < 1:
            raise ValueError("--router-max-ongoing must be at least 1")
        if self.hold_margin < 0:
            raise ValueError("--router-hold-margin cannot be negative")


KV_TRANSFER_TIMEOUT_S = 30.0  # `--kv-transfer-timeout`'s default
KV_STAGINGS = ("shm", "zmq")  # `--kv-staging`'s choices, the default first

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
    # Serve autoscaling of the engine replicas (off unless `max_replicas` is set): between `min_replicas`
    # and `max_replicas`, starting at `replicas`, aiming at `target_ongoing_requests` per replica
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # None: the engine's `max_num_seqs` (a full batch)
    # prefill/decode disaggregation (`--prefill-replicas P --decode-replicas D`, instead of `replicas`)
    prefill_replicas: int = 0
    decode_replicas: int = 0
    # disaggregated: how long a request's KV handoff may take (the prefill's export reaching the ingress,
    # the decode replica fetching the blocks and its engine importing them) before it is cancelled
    kv_transfer_timeout_s: float = KV_TRANSFER_TIMEOUT_S
    # disaggregated: a prompt of at most this many tokens is prefilled by the decode replica itself (no
    # KV handoff, whose hops cost more than such a prefill stalls the running decodes); 0: none is
    local_prefill_tokens: int = 0
    # disaggregated: how a decode replica hands the fetched KV blocks to its engine: "shm" (a file in
    # host shared memory the engine copies from) or "zmq" (the bytes inline in the import message)
    kv_staging: str = "shm"
    spread: SpreadPolicy = field(default_factory=SpreadPolicy)
    queue: RouterQueue = field(default_factory=RouterQueue)
    # start even when the alive nodes cannot hold the replicas now (a Ray autoscaler adds nodes on
    # demand); False: refuse such a start with the reason (`run.check_cluster`)
    wait_for_nodes: bool = False

    def autoscaling_config(self, default_target: float) -> dict[str, float | int] | None:
        """Serve's `autoscaling_config` for the engine deployment (None: a fixed `replicas`); the target
        is `target_ongoing_requests`, else `default_target`. Serve's delays stay at its defaults (up
        after 30 s over the target, down after 600 s under it)."""
        if self.max_replicas is None:
            return None
        return {
            "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests or default_target,
        }

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
            if self.max_replicas is not None or self.min_replicas is not None:
                raise ValueError("autoscaling (--min/--max-replicas) applies to colocated --replicas only")
            if not 0 < self.kv_transfer_timeout_s <= 3600:
                raise ValueError("--kv-transfer-timeout must be in (0, 3600] seconds")
            if self.kv_staging not in KV_STAGINGS:
                raise ValueError(f"--kv-staging must be one of {', '.join(KV_STAGINGS)}")
            if self.local_prefill_tokens < 0:
                raise ValueError("--local-prefill-tokens cannot be negative")
        elif self.local_prefill_tokens:
            raise ValueError("--local-prefill-tokens applies to --prefill-replicas/--decode-replicas only")
        if not self.disaggregated and self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.ingress_replicas < 1:
            raise ValueError("--ingress-replicas must be at least 1")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("--cpus-per-replica and --gpus-per-replica cannot be negative")
        self._validate_autoscaling()
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        self.router_weights.validate()
        self.spread.validate()
        self.queue.validate()

    def _validate_autoscaling(self) -> None:
        """Raise ValueError unless min ≤ replicas ≤ max, min ≥ 1 and the target is positive; the bounds
        and the target mean nothing without `--max-replicas`."""
        if self.max_replicas is None:
            if self.min_replicas is not None or self.target_ongoing_requests is not None:
                raise ValueError(
                    "--min-replicas and --target-ongoing-requests need --max-replicas (autoscaling)"
                )
            return
        low = self.min_replicas if self.min_replicas is not None else 1
        if low < 1:
            raise ValueError("--min-replicas must be at least 1 (the ingress needs an engine replica)")
        if self.max_replicas < low:
            raise ValueError(f"--max-replicas ({self.max_replicas}) is below --min-replicas ({low})")
        if not low <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"--replicas ({self.replicas}), the replicas to start with, must lie between "
                f"--min-replicas ({low}) and --max-replicas ({self.max_replicas})"
            )
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be positive")
