"""OLMoE (`OlmoeForCausalLM`: OLMoE-1B-7B): Llama's blocks with RMSNorm over the whole q and k rows
(`q_norm` of q_size, `k_norm` of kv_size, before the split into heads and RoPE), the optional `clip_qkv`
clamp of q, k and v, and the MoE block of `engine/model/moe.py` in every layer (softmax before top-k,
`norm_topk_prob`, default off; the experts' size is `intermediate_size`).

Checkpoints: fused 3-D `mlp.experts.gate_up_proj` / `down_proj` or per-expert `mlp.experts.N.*`.
LoRA: attention projections only (`moe.MOE_LORA_TARGETS`); LoRA on q/k applies before their norms, as
PEFT's wrapped `q_proj` does. Adapters on the router or experts are refused (`moe.MOE_REFUSED_TARGETS`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.decoder import Attention
from engine.model.family import ModelFamily
from engine.model.gguf_moe import GGUF_MOE_LAYER_MODULES, gguf_moe_tensor, moe_gguf_config
from engine.model.layers import RMSNorm
from engine.model.linear import LoRAStepContext
from engine.model.moe import (
    MOE_LORA_TARGETS,
    MOE_REFUSED_TARGETS,
    MoEDecoderLayer,
    MoEForCausalLM,
    moe_settings,
)
from engine.model.rope import RotaryEmbedding
from engine.model_config import ModelConfig


class OlmoeAttention(Attention):
    """The shared attention with q and k normed as whole rows and q/k/v clamped to ±`clip_qkv`."""

    head_qk_norm = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__(cfg, layer, rope)
        self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)
        self.clip_qkv: float | None = cfg.extra.get("clip_qkv")

    def project_qkv(self, x: torch.Tensor, lora: LoRAStepContext | None) -> torch.Tensor:
        """q|k|v with q and k normed in place (then clamped, with v, where `clip_qkv` is set)."""
        assert self.q_norm is not None and self.k_norm is not None
        qkv = self.qkv_proj(x, lora)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv[:, :q] = self.q_norm(qkv[:, :q])
        qkv[:, q : q + kv] = self.k_norm(qkv[:, q : q + kv])
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv


class OlmoeDecoderLayer(MoEDecoderLayer):
    """The MoE layer with OLMoE's attention."""

    def make_attention(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> Attention:
        return OlmoeAttention(cfg, layer, rope)


class OlmoeForCausalLM(MoEForCausalLM):
    """The shared MoE decoder with OLMoE's layers."""

    layer_cls = OlmoeDecoderLayer


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE settings and `clip_qkv` (None: no clamp)."""
    clip = raw.get("clip_qkv")
    return {"extra": {"moe": moe_settings(raw), "clip_qkv": None if clip is None else float(clip)}}


FAMILY = ModelFamily(
    architectures=("OlmoeForCausalLM",),
    build=OlmoeForCausalLM,
    configure=configure,
    lora_targets=MOE_LORA_TARGETS,
    lora_refused=MOE_REFUSED_TARGETS,
    gguf_layer_modules=GGUF_MOE_LAYER_MODULES,
    gguf_config=moe_gguf_config(norm_topk_prob=False),
    gguf_tensor=gguf_moe_tensor,
)
