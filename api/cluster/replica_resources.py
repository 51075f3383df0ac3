"""What one engine replica asks Ray for, and whether a cluster's nodes can hold the replicas.

At `tensor_parallel_size` N a replica is N ranks: the replica actor's engine process is rank 0 and starts
ranks 1..N-1 as its own subprocesses (`engine/distributed/worker_group.py`), which Ray does not see. So
such a replica reserves every rank's resources in one placement group of N bundles, strategy
`STRICT_PACK` (all on one node):

    bundle 0      {CPU: c, GPU: g}   the replica actor: rank 0's CPUs and every GPU of the replica
    bundle 1..N-1 {CPU: c}           one rank's CPUs each

The GPUs sit in bundle 0 because Ray shows a process only the GPUs its own actor holds
(`CUDA_VISIBLE_DEVICES`), and ranks 1..N-1 are children of that actor's engine process, which give rank r
`cuda:r` of those devices. On CPU a rank's CPUs are its threads: `--threads / N` (at least 1), or
`--cpus-per-replica / N` when that is given. At N = 1 nothing changes: the actor asks for
`--cpus-per-replica` (default 0: Ray does not count the engine's threads) and `--gpus-per-replica`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.engine_config import EngineConfig

STRATEGY = "STRICT_PACK"  # a replica's bundles on one node


@dataclass(frozen=True, slots=True)
class ReplicaResources:
    ranks: int  # tensor-parallel ranks of one replica
    cpus_per_rank: float  # Ray CPUs each rank reserves (the replica actor takes rank 0's)
    gpus: float  # Ray GPUs of the whole replica (held by the replica actor)

    @property
    def cpus(self) -> float:
        return self.ranks * self.cpus_per_rank

    def bundles(self) -> list[dict[str, float]] | None:
        """The replica's placement-group bundles (None at one rank: plain actor options)."""
        if self.ranks == 1:
            return None
        first = {"CPU": self.cpus_per_rank} | ({"GPU": self.gpus} if self.gpus else {})
        return [first] + [{"CPU": self.cpus_per_rank} for _ in range(self.ranks - 1)]

    def demand(self) -> dict[str, float]:
        """What one replica needs on a single node (resources it asks none of left out)."""
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}

    def describe(self) -> str:
        """E.g. `2 CPU, 0 GPU each, 2 ranks packed on one node`."""
        text = f"{self.cpus:g} CPU, {self.gpus:g} GPU each"
        return text if self.ranks == 1 else f"{text}, {self.ranks} ranks packed on one node"


def replica_resources(
    engine: EngineConfig, cpus_per_replica: float, gpus_per_replica: float
) -> ReplicaResources:
    """The resources of one engine replica for `engine`'s tensor-parallel size (see the module doc);
    ValueError (one line) for a GPU count that cannot give every rank its device."""
    ranks = engine.tensor_parallel_size
    if ranks <= 1:
        return ReplicaResources(1, cpus_per_replica, gpus_per_replica)
    if cpus_per_replica:
        per_rank = cpus_per_replica / ranks
    else:
        per_rank = float(max(1, (engine.num_threads or ranks) // ranks))
    gpus = gpus_per_replica
    if _on_gpus(engine):
        gpus = gpus or float(ranks)
        if gpus < ranks:
            raise ValueError(
                f"--tensor-parallel-size {ranks} on GPUs needs one GPU per rank: --gpus-per-replica "
                f"{ranks} (or leave it out), not {gpus:g}"
            )
    return ReplicaResources(ranks, per_rank, gpus)


def _on_gpus(engine: EngineConfig) -> bool:
    """The engine runs on CUDA devices (`cuda`, or `auto` where this process sees one)."""
    if engine.device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return engine.device.startswith("cuda")


def fitting_replicas(resources: ReplicaResources, nodes: list[dict[str, float]]) -> int | None:
    """How many replicas the `nodes` (each node's total resources) hold, each replica on one node; None
    when a replica asks for nothing countable (any number fits)."""
    demand = resources.demand()
    if not demand:
        return None
    return sum(min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in demand.items()) for node in nodes)


def fit_error(resources: ReplicaResources, nodes: list[dict[str, float]], replicas: int) -> str | None:
    """None when the `nodes` can hold `replicas` replicas; else a one-line reason naming what one replica
    needs and what the nodes have."""
    fits = fitting_replicas(resources, nodes)
    if fits is None or fits >= replicas:
        return None
    need = ", ".join(f"{v:g} {k}" for k, v in resources.demand().items())
    how = "" if resources.ranks == 1 else f" ({resources.ranks} tensor-parallel ranks)"
    have = (
        "; ".join(", ".join(f"{node.get(k, 0.0):g} {k}" for k in resources.demand()) for node in nodes)
        or "none alive"
    )
    return (
        f"the Ray cluster can place {fits} of the {replicas} engine replica(s): each needs {need} on "
        f"one node{how}, and its {len(nodes)} node(s) have {have}; add nodes, or lower --replicas, "
        f"--tensor-parallel-size or --threads (--wait-for-nodes: start anyway, for an autoscaling cluster)"
    )
