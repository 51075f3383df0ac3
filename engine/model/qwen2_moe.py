"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias,
`qkv_bias`) and the MoE block of `engine/model/moe.py` with a shared expert: a dense gated MLP of
`shared_expert_intermediate_size` whose output is scaled by `sigmoid(x @ shared_expert_gate.T)` and added
to the routed experts'. Softmax before top-k, `norm_topk_prob` (default off), dense layers by
`decoder_sparse_step` / `mlp_only_layers`.

Checkpoints: fused 3-D `mlp.experts.gate_up_proj` / `down_proj` or per-expert `mlp.experts.N.*`; the
shared expert's `gate_proj` / `up_proj` fill its packed gate|up projection.
LoRA: attention projections only (`moe.MOE_LORA_TARGETS`); adapters on the router, the experts or the
shared expert are refused (`moe.MOE_REFUSED_TARGETS`).
"""

from __future__ import annotations

from typing import Any

from engine.model.family import LLAMA_CHECKPOINT_MODULES, ModelFamily
from engine.model.gguf_moe import GGUF_MOE_LAYER_MODULES, gguf_moe_tensor, moe_gguf_config
from engine.model.moe import MOE_LORA_TARGETS, MOE_REFUSED_TARGETS, MoEForCausalLM, moe_settings


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """q/k/v bias (`qkv_bias`, default on) and the MoE settings with the shared expert's size."""
    return {"qkv_bias": bool(raw.get("qkv_bias", True)), "extra": {"moe": moe_settings(raw)}}


FAMILY = ModelFamily(
    architectures=("Qwen2MoeForCausalLM",),
    build=MoEForCausalLM,
    configure=configure,
    checkpoint_modules={
        **LLAMA_CHECKPOINT_MODULES,
        "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
        "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
    },
    lora_targets=MOE_LORA_TARGETS,
    lora_refused=MOE_REFUSED_TARGETS,
    gguf_layer_modules=GGUF_MOE_LAYER_MODULES,
    gguf_config=moe_gguf_config(norm_topk_prob=False),
    gguf_tensor=gguf_moe_tensor,
)
