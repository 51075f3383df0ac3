"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on each
q and k head), the MoE block of `engine/model/moe.py` in every `decoder_sparse_step`-th layer not in
`mlp_only_layers` (a dense MLP of `intermediate_size` there), softmax before top-k, `norm_topk_prob`.

Checkpoints: transformers 5's fused 3-D `mlp.experts.gate_up_proj` / `down_proj`, or the per-expert
`mlp.experts.N.gate_proj/up_proj/down_proj` (what transformers 5 still writes, and older checkpoints).
LoRA: attention projections only (`moe.MOE_LORA_TARGETS`); adapters on the router or experts are
refused (`moe.MOE_REFUSED_TARGETS`).
"""

from __future__ import annotations

from typing import Any

from engine.model.family import ModelFamily
from engine.model.gguf_moe import GGUF_MOE_LAYER_MODULES, gguf_moe_tensor, moe_gguf_config
from engine.model.moe import MOE_LORA_TARGETS, MOE_REFUSED_TARGETS, MoEForCausalLM, moe_settings


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3's q/k norm and the MoE settings (`num_experts`)."""
    return {"qk_norm": True, "extra": {"moe": moe_settings(raw)}}


FAMILY = ModelFamily(
    architectures=("Qwen3MoeForCausalLM",),
    build=MoEForCausalLM,
    configure=configure,
    lora_targets=MOE_LORA_TARGETS,
    lora_refused=MOE_REFUSED_TARGETS,
    gguf_layer_modules=GGUF_MOE_LAYER_MODULES,
    gguf_config=moe_gguf_config(norm_topk_prob=True),
    gguf_tensor=gguf_moe_tensor,
)
