"""OLMoE (`OlmoeForCausalLM`: OLMoE-1B-7B): Llama's blocks with RMSNorm over the whole q and k rows
(`q_norm` of q_size, `k_norm` of kv_size, before the split into heads and RoPE), the optional `clip_qkv`
clamp of q, k and v, and the MoE block of `engine/model/moe.py` in every layer (softmax before top-k,
`norm_topk_prob`, default off; the experts' size is `intermediate_size`).

Checkpoints: fused 3-D `mlp.experts.gate_up_proj` / `down_proj` or per-expert `mlp.experts.N.*`.
LoRA: attention projections only (`moe.MOE_LORA_TARGETS`); LoRA on q/k applies before their norms, as
PEFT's wrapped `q_proj` does. Adapters on the router or experts are refused (`moe.MOE_REFUSED_TARGETS`).
"""

from __future__ import annotations

from collections.abc import Callable
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
        # tensor parallel (`engine/distributed/moe_shard.py`): this rank holds its heads' part of q and k;
        # the norms' sums of squares are summed over the ranks (whole q / k widths; replicated KV heads)
        self.norm_all_reduce: Callable[[torch.Tensor], None] | None = None
        self.norm_widths = (cfg.q_size, cfg.kv_size)
        self.kv_replicas = 1.0

    def project_qkv(self, x: torch.Tensor, lora: LoRAStepContext | None) -> torch.Tensor:
        """q|k|v with q and k normed in place (then clamped, with v, where `clip_qkv` is set)."""
        assert self.q_norm is not None and self.k_norm is not None
        qkv = self.qkv_proj(x, lora)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.norm_all_reduce is None:
            qkv[:, :q] = self.q_norm(qkv[:, :q])
            qkv[:, q : q + kv] = self.k_norm(qkv[:, q : q + kv])
        else:
            self._sharded_norms(qkv, q, kv)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv

    def _sharded_norms(self, qkv: torch.Tensor, q: int, kv: int) -> None:
        """q and k normed in place over their whole rows, this rank holding its heads' part of each: one
        all-reduce of both rows' local sums of squares ([T, 2])."""
        assert self.q_norm is not None and self.k_norm is not None and self.norm_all_reduce is not None
        qf, kf = qkv[:, :q].float(), qkv[:, q : q + kv].float()
        sq = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=1)
        self.norm_all_reduce(sq)
        sq[:, 1] /= self.kv_replicas
        eps = self.q_norm.eps
        qkv[:, :q] = self.q_norm.weight * (qf * torch.rsqrt(sq[:, :1] / self.norm_widths[0] + eps)).to(
            qkv.dtype
        )
        kn = (kf * torch.rsqrt(sq[:, 1:] / self.norm_widths[1] + self.k_norm.eps)).to(qkv.dtype)
        qkv[:, q : q + kv] = self.k_norm.weight * kn


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
