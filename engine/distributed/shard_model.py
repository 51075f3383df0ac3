"""Build one tensor-parallel rank's model: its shard of the checkpoint, wired to the group's all-reduce.

Rank 0 (the engine process) and every worker build theirs the same way, so the shards agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.distributed.moe_shard import wire_moe
from engine.distributed.shard import ROW_PARALLEL_MODULES, TensorShard
from engine.model.decoder import DecoderForCausalLM
from engine.model.linear import ProjectionLinear
from engine.model.loader import load_model
from engine.model_config import ModelConfig


def load_shard(
    checkpoint: ModelConfig,
    shard: TensorShard,
    dtype: torch.dtype,
    device: torch.device,
    all_reduce: Callable[[torch.Tensor], None],
    packed_cpu_gemms: bool = True,
) -> DecoderForCausalLM:
    """The model of `shard` (`engine/distributed/shard.py`) with every row-parallel projection (o, down)
    summing its partial output over the ranks through `all_reduce`, and every MoE block its one sum
    (`engine/distributed/moe_shard.py`); CPU GEMMs packed as at TP=1."""
    model = load_model(checkpoint, dtype, device, shard)
    if packed_cpu_gemms:
        model.pack_cpu_gemms()
    for module in model.modules():
        if isinstance(module, ProjectionLinear) and module.slice_names[0] in ROW_PARALLEL_MODULES:
            module.all_reduce = all_reduce
    if checkpoint.extra.get("moe"):  # one all-reduce per MoE block (and OLMoE's q/k norms)
        wire_moe(model, shard, all_reduce)
    if device.type == "cuda":  # on CPU every rank replays its own (`engine/decode_graphs.py`)
        model.graph_problem = "CUDA graphs are not captured under tensor parallel on GPUs yet"
    return model
