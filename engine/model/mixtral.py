"""Mixtral (`MixtralForCausalLM`): Mistral's attention (its sliding window when the config sets one) and
the MoE block of `engine/model/moe.py` in every layer: softmax, top-k, the top-k weights always
renormalized (transformers' `MixtralTopKRouter`).

Checkpoints: transformers 5's fused 3-D `mlp.experts.gate_up_proj` / `down_proj`, or the per-expert
`block_sparse_moe.experts.N.w1/w3/w2` with the router `block_sparse_moe.gate` (what transformers 5
writes, and older checkpoints; `checkpoint_key` maps `block_sparse_moe` to `mlp`).
LoRA: attention projections only (`moe.MOE_LORA_TARGETS`); adapters on the router or experts are
refused (`moe.MOE_REFUSED_TARGETS`).
"""

from __future__ import annotations

from typing import Any

from engine.model.family import ModelFamily
from engine.model.gguf_moe import GGUF_MOE_LAYER_MODULES, gguf_moe_tensor, moe_gguf_config
from engine.model.moe import MOE_LORA_TARGETS, MOE_REFUSED_TARGETS, MoEForCausalLM, moe_settings


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE settings (renormalized top-k) and the sliding window, if any."""
    out: dict[str, Any] = {"extra": {"moe": moe_settings(raw, norm_topk_prob=True)}}
    if raw.get("sliding_window"):
        out["sliding_window"] = int(raw["sliding_window"])
    return out


def checkpoint_key(key: str) -> str | None:
    """The older layout's `block_sparse_moe.` is our (and transformers 5's) `mlp.`."""
    return key.replace(".block_sparse_moe.", ".mlp.")


FAMILY = ModelFamily(
    architectures=("MixtralForCausalLM",),
    build=MoEForCausalLM,
    configure=configure,
    checkpoint_key=checkpoint_key,
    lora_targets=MOE_LORA_TARGETS,
    lora_refused=MOE_REFUSED_TARGETS,
    gguf_permuted=("MixtralForCausalLM",),
    gguf_layer_modules=GGUF_MOE_LAYER_MODULES,
    gguf_config=moe_gguf_config(norm_topk_prob=True),
    gguf_tensor=gguf_moe_tensor,
)
