"""What a validated adapter is: its projections' LoRA weights (`LoRAModuleWeights`), the whole adapter
(`AdapterCheckpoint`), and the shapes of the engine's LoRA slices in a base model.

The engine's slices (`PROJECTIONS`) are Llama's seven projections whatever names a family's adapters use:
a fused target (Phi-3's `qkv_proj`, `gate_up_proj`) is split into its slices when it is read
(`engine/lora/projection_lora.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.lora.expert_checkpoint import ExpertLoRAWeights
from engine.lora.vocab_checkpoint import SavedModule, TrainableTokens, VocabLoRAWeights
from engine.model.family import LoRATarget
from engine.model_config import ModelConfig

# The engine's LoRA slices (the adapter pool's modules), whatever names the family's adapters use
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True, frozen=True)
class LoRAModuleWeights:
    """One adapted engine slice (`PROJECTIONS`): `delta_y = scaling * (x @ lora_a.T) @ lora_b.T`."""

    layer: int
    module: str
    rank: int
    alpha: float
    scaling: float
    lora_a: torch.Tensor | None  # [rank, in_features]; None when inspected without weights
    lora_b: torch.Tensor | None  # [out_features, rank]
    magnitude: torch.Tensor | None = None  # DoRA: [out_features] (None: plain LoRA, or no weights loaded)
    bias_b: torch.Tensor | None = None  # lora_bias: lora_B's bias [out_features] (added times scaling)


@dataclass(slots=True, frozen=True)
class AdapterCheckpoint:
    """A validated adapter: its identity, summary facts and (optionally) its weights."""

    digest: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # the family's module names the adapter has weights for
    use_rslora: bool
    size_bytes: int
    base_model_name: str | None
    modules: tuple[LoRAModuleWeights, ...]
    use_dora: bool = False
    lora_bias: bool = False
    vocab: tuple[VocabLoRAWeights, ...] = ()  # LoRA on embed_tokens / lm_head
    tokens: tuple[TrainableTokens, ...] = ()  # trainable_token_indices: replaced rows of embed / head
    saved: tuple[SavedModule, ...] = ()  # modules_to_save: whole copies of embed_tokens / lm_head
    experts: tuple[ExpertLoRAWeights, ...] = ()  # LoRA on a MoE model's routed experts
    # what the engine derives from these weights and the base model (DoRA's epilogue vectors), kept with
    # the host copy so it is computed once per load; not part of the adapter's identity
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def module_features(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of the engine's LoRA slice `module` (`PROJECTIONS`) in `model`."""
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def target_features(model: ModelConfig, target: LoRATarget) -> tuple[int, int]:
    """(in_features, out_features) of a family's LoRA target: its slices' input, their summed outputs."""
    return module_features(model, target.slices[0])[0], sum(
        module_features(model, s)[1] for s in target.slices
    )
