"""Rank 0's tensor-parallel set-up: the checks, the per-rank CPU threads, its shard and the worker group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cpu_threads import available_cpus
from engine.distributed.shard import TensorShard, check_tensor_parallel
from engine.distributed.worker_group import WorkerGroup
from engine.engine_config import EngineConfig
from engine.model_config import ModelConfig


@dataclass(slots=True)
class TensorParallel:
    shard: TensorShard  # rank 0's
    group: WorkerGroup  # ranks 1..N-1 (started by the engine once its KV cache and pool are sized)


def tensor_parallel(
    config: EngineConfig, checkpoint: ModelConfig, device: torch.device
) -> TensorParallel | None:
    """None at `tensor_parallel_size=1`; else rank 0's shard and its (not yet started) worker group,
    after one-line ValueErrors for sizes the model or machine cannot take. On CPU every rank, this one
    included, gets `num_threads // N` threads (`num_threads` default: the CPUs this process may use)."""
    world = config.tensor_parallel_size
    if isinstance(world, int) and world > 1:
        # the model's limits first: they hold on any machine
        check_tensor_parallel(checkpoint, world, config.enable_expert_parallel)
    config.check_parallel()
    if world == 1:
        return None
    threads = 1
    if device.type == "cpu":
        threads = max(1, (config.num_threads or available_cpus()) // world)
        torch.set_num_threads(threads)
    group = WorkerGroup(config, world, device, threads, config.distributed_timeout)
    return TensorParallel(rank_shard(0, world, checkpoint, config), group)


def rank_shard(rank: int, world: int, checkpoint: ModelConfig, config: EngineConfig) -> TensorShard:
    """Rank `rank`'s shard of `checkpoint` under `config`'s parallel settings (rank 0's and the workers')."""
    return TensorShard(
        rank,
        world,
        checkpoint,
        config.fully_sharded_loras,
        config.enable_expert_parallel and bool(checkpoint.extra.get("moe")),
        config.expert_placement,
    )
