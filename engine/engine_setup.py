"""Parts of building an `LLMEngine` that are a computation of their own: the CPU thread governor, this
rank's model, the KV cache's size, the end-of-sequence ids, the LoRA manager, and starting the
tensor-parallel workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.cpu_threads import ThreadGovernor, available_cpus
from engine.distributed.setup import TensorParallel
from engine.distributed.shard_model import load_shard
from engine.distributed.worker_group import WorkerGroup
from engine.engine_config import EngineConfig
from engine.lora.dora import ProjectionBaseWeights
from engine.lora.manager import LoRAManager
from engine.model.decoder import DecoderForCausalLM
from engine.model.loader import load_model
from engine.model_config import ModelConfig, resolve_lora_dtype
from engine.model_runner import kv_block_bytes
from kernels.intmath import cdiv


def cpu_thread_governor(
    config: EngineConfig, device: torch.device, tp: TensorParallel | None
) -> ThreadGovernor | None:
    """On a CPU: cap torch's default thread count at the available CPUs (one rank, no `num_threads`),
    and the thread governor when `adaptive_threads` and more than one thread (under tensor parallel rank
    0's governor sets every rank's, with the group's collective cost); None elsewhere."""
    if device.type != "cpu":
        return None
    if tp is None and config.num_threads is None:  # torch's default can exceed the CPUs
        torch.set_num_threads(min(torch.get_num_threads(), available_cpus()))
    if config.adaptive_threads and torch.get_num_threads() > 1:
        cost = tp.group.collective_cost if tp is not None else None
        return ThreadGovernor(torch.get_num_threads(), overhead=cost)
    return None


def load_rank_model(
    config: EngineConfig,
    checkpoint: ModelConfig,
    tp: TensorParallel | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """(this rank's model, its config capped at `max_model_len`): the whole model at one rank (its CPU
    GEMMs packed when `packed_cpu_gemms`), else rank 0's shard, whose projections all-reduce over
    the group."""
    if tp is None:
        model = load_model(checkpoint, dtype, device)
        if config.packed_cpu_gemms:
            model.pack_cpu_gemms()
        return model, checkpoint.capped(config.max_model_len)
    shard = load_shard(checkpoint, tp.shard, dtype, device, tp.group.all_reduce, config.packed_cpu_gemms)
    return shard, tp.shard.local_config().capped(config.max_model_len)


def num_kv_blocks(
    config: EngineConfig,
    rank_config: ModelConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """KV blocks to allocate: `config.num_kv_blocks` when set, else as many of this rank's blocks as the
    KV budget holds, but no more than `max_num_seqs` full-context sequences need (at least one)."""
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {config.num_kv_blocks}")
        return config.num_kv_blocks
    per_block = kv_block_bytes(rank_config, config.block_size, dtype)
    by_budget = config.kv_budget_bytes(device) // per_block
    enough = config.max_num_seqs * cdiv(model_config.max_model_len, config.block_size)
    return max(1, int(min(by_budget, enough)))


def eos_token_ids(model_dir: str, model_config: ModelConfig, tokenizer: Any | None) -> tuple[int, ...]:
    """The token ids that end a sequence, sorted: the checkpoint config's, its generation_config.json's
    `eos_token_id` (one or a list) and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def make_lora_manager(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    model: torch.nn.Module,
    tp: TensorParallel | None,
) -> LoRAManager | None:
    """The adapter manager and pool `config` asks for (None without `enable_lora`); under tensor
    parallel it holds this rank's shard of each adapter and reduces through the worker group."""
    if not config.enable_lora:
        return None
    lora = LoRAManager.create(
        model_config,
        resolve_lora_dtype(config.lora_dtype, dtype),
        device,
        compute_dtype=dtype,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        num_pages=config.adapter_pool_pages(),
        page_rank=config.lora_page_rank,
        max_loras=config.max_loras,
        backend=config.lora_backend,
        side_budget=config.lora_side_memory_bytes,
        base=ProjectionBaseWeights(model),  # this rank's shard under tensor parallel
        shard=tp.shard if tp is not None else None,
    )
    if tp is not None:
        lora.pool.all_reduce = tp.group.all_reduce  # row-parallel DoRA norms
        if tp.shard.fully_sharded:
            lora.pool.all_gather = tp.group.all_gather
    return lora


def start_worker_group(group: WorkerGroup, num_blocks: int, lora: LoRAManager | None) -> None:
    """Start the tensor-parallel workers with this rank's KV cache size and adapter pool."""
    group.num_kv_blocks = num_blocks
    if lora is not None:
        group.lora_backend = lora.backend
        group.pool = lora.pool
        lora.pool.journal = []
    group.start()
