"""What an engine replica asks Ray for at `--tensor-parallel-size N` (a `STRICT_PACK` placement group of
its ranks), whether a cluster's nodes can hold the replicas, and the deployment options Serve gets.
No cluster: tests/api/cluster/test_multinode.py runs the same on two real Ray nodes."""

from __future__ import annotations

import pytest

from api.cluster.options import ClusterOptions
from api.cluster.replica_resources import ReplicaResources, fit_error, fitting_replicas, replica_resources
from api.settings import ServerSettings
from engine.engine_config import EngineConfig
from tests.api.cluster.conftest import DEMO

MODEL = str(DEMO / "base")


def test_one_rank_keeps_the_plain_actor_options() -> None:
    res = replica_resources(EngineConfig(model=MODEL, device="cpu"), 0, 0)
    assert res == ReplicaResources(1, 0, 0) and res.bundles() is None and res.demand() == {}
    assert replica_resources(EngineConfig(model=MODEL, device="cpu"), 2, 1).demand() == {"CPU": 2, "GPU": 1}


def test_tensor_parallel_ranks_reserve_their_threads_together() -> None:
    cpu = EngineConfig(model=MODEL, device="cpu", num_threads=4, tensor_parallel_size=2)
    res = replica_resources(cpu, 0, 0)
    assert res.bundles() == [{"CPU": 2.0}, {"CPU": 2.0}]  # --threads 4 over 2 ranks
    assert res.demand() == {"CPU": 4.0}
    assert res.describe() == "4 CPU, 0 GPU each, 2 ranks packed on one node"
    # no --threads: one CPU per rank at least; --cpus-per-replica: split over the ranks
    assert replica_resources(EngineConfig(model=MODEL, device="cpu", tensor_parallel_size=2), 0, 0).cpus == 2
    assert replica_resources(cpu, 6, 0).bundles() == [{"CPU": 3.0}, {"CPU": 3.0}]


def test_gpu_ranks_get_their_devices_through_the_replica_actor() -> None:
    gpu = EngineConfig(model=MODEL, device="cuda", num_threads=2, tensor_parallel_size=4)
    res = replica_resources(gpu, 0, 0)  # CUDA: one GPU per rank by default
    assert res.bundles() == [{"CPU": 1.0, "GPU": 4.0}] + [{"CPU": 1.0}] * 3
    assert res.demand() == {"CPU": 4.0, "GPU": 4.0}
    with pytest.raises(ValueError, match="needs one GPU per rank: --gpus-per-replica 4"):
        replica_resources(gpu, 0, 2)


def test_the_fit_counts_whole_replicas_per_node() -> None:
    res = ReplicaResources(2, 1.0, 2.0)  # needs 2 CPU and 2 GPU on one node
    two_small = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]  # 2 GPUs, but not on one node
    assert fitting_replicas(res, two_small) == 0
    assert fitting_replicas(res, [{"CPU": 4.0, "GPU": 4.0}, {"CPU": 16.0, "GPU": 2.0}]) == 3
    assert fit_error(res, [{"CPU": 4.0, "GPU": 4.0}], 2) is None
    error = fit_error(res, two_small, 1)
    assert error is not None and "\n" not in error
    assert error.startswith("the Ray cluster can place 0 of the 1 engine replica(s): each needs 2 CPU, 2 GPU")
    assert "(2 tensor-parallel ranks)" in error and "8 CPU, 1 GPU; 8 CPU, 1 GPU" in error
    assert fit_error(ReplicaResources(1, 0, 0), [], 5) is None  # asks for nothing countable
    assert fitting_replicas(ReplicaResources(1, 0, 0.5), [{"GPU": 1.0}]) == 2  # fractions share a GPU


def test_the_engine_deployment_asks_serve_for_a_strict_pack_group(tmp_path) -> None:
    from api.cluster.deployments import engine_deployment, ingress_deployment

    settings = ServerSettings.build(
        str(DEMO / "base"),
        env={"LORAPLEX_DATA_DIR": str(tmp_path)},
        engine_kwargs={"device": "cpu", "num_threads": 2, "tensor_parallel_size": 2},
    )
    engine = engine_deployment(settings, ClusterOptions(2))
    config = engine._replica_config
    assert config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert config.placement_group_strategy == "STRICT_PACK"
    assert engine.ray_actor_options["num_cpus"] == 1.0  # the actor is rank 0, in bundle 0
    # the ingress runs beside Serve's proxy, on the head node
    ingress = ingress_deployment(settings, ClusterOptions(2))
    assert ingress.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
