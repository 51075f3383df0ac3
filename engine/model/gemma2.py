"""The Gemma 2 family (`Gemma2ForCausalLM`) on the shared decoder, exactly as transformers 5 computes it.

What differs from Llama:
- RMSNorm scales by ``(1 + w)``, in float32, then casts (`GemmaRMSNorm`);
- each layer norms around both branches: ``x += post_attn_norm(attn(input_norm(x)))``,
  ``x += post_ff_norm(mlp(pre_ff_norm(x)))``;
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` (`gelu_pytorch_tanh`);
- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
  (``attn_logit_softcapping``), the logits too (``final_logit_softcapping``): ``cap * tanh(x / cap)``;
- layers alternate sliding-window (``sliding_window``) and global attention (``layer_types``: even layers
  slide by default).

GGUF files (`gemma2`): llama.cpp's tensor names, its 1 + w norm weights, the window and caps from the
metadata (`gguf_config`).

The norms, GeGLU and post-norms have no fused native CPU op: the CPU takes the torch formulas (logged
once), with the packed GEMMs and the native paged attention (which soft-caps and windows).
Gemma 3 (`engine/model/gemma3.py`) builds on these blocks.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.model.cpu_fused import use_fused
from engine.model.decoder import MLP, Attention, DecoderForCausalLM, DecoderLayer
from engine.model.family import GGUFMeta, GGUFVector, ModelFamily
from engine.model.layers import ForwardBatch
from engine.model.linear import LoRAStepContext
from engine.model.rope import RotaryEmbedding
from engine.model_config import ModelConfig, ModelConfigError

log = logging.getLogger(__name__)

SLIDING, GLOBAL = "sliding_attention", "full_attention"
GELU_TANH = "gelu_pytorch_tanh"


class GemmaRMSNorm(nn.Module):
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + w), computed in float32 and cast to x's dtype (as HF)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)) with gate|up packed in one projection."""

    def forward(self, x: torch.Tensor, lora: LoRAStepContext | None, fused=None):
        gu = self.gate_up_proj(x, lora)
        h = nn.functional.gelu(gu[:, : self.inter], approximate="tanh") * gu[:, self.inter :]
        return self.down_proj(h, lora)


class GemmaDecoderLayer(DecoderLayer):
    """Norms before and after attention and MLP; the layer's attention slides or is global
    (`cfg.extra["layer_types"]`), with Gemma's score scale and soft-cap."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        self.kind = cfg.extra["layer_types"][layer]
        super().__init__(cfg, layer, rope)
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)  # type: ignore[assignment]
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)  # type: ignore[assignment]
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GemmaMLP(cfg, layer)

    def make_attention(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> Attention:
        window = int(cfg.sliding_window or 0) if self.kind == SLIDING else 0
        scale = float(cfg.extra["query_pre_attn_scalar"]) ** -0.5
        return Attention(cfg, layer, rope, scale, window, float(cfg.extra.get("attn_softcap") or 0.0))

    def forward(self, x, rope_tables, kv, batch: ForwardBatch, backend):
        """`rope_tables`: the step's tables by layer kind (sliding / global)."""
        a = self.self_attn(self.input_layernorm(x), rope_tables[self.kind], kv, batch, backend)
        x = x + self.post_attention_layernorm(a)
        f = self.mlp(self.pre_feedforward_layernorm(x), batch.lora)
        return x + self.post_feedforward_layernorm(f)


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Scaled embeddings, Gemma layers, (1 + w) final norm, soft-capped logits (module docstring)."""

    layer_cls = GemmaDecoderLayer
    activations = (GELU_TANH,)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # type: ignore[assignment]
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.final_softcap = float(cfg.extra.get("final_softcap") or 0.0)
        self.fused_problem = "Gemma's (1 + w) RMSNorm, post-norms and GeGLU have no fused CPU op"

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        x = self.lookup(input_ids, batch)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the dtype, as HF

    def head(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        logits = self.logits(x, batch)
        if self.final_softcap > 0:  # in the model's dtype, as HF
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The step's RoPE tables by layer kind: one set for both in Gemma 2."""
        tables = self.rope.tables(positions)
        return {SLIDING: tables, GLOBAL: tables}

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.embed(batch.input_ids, batch)
        if not self._fallback_logged and use_fused(x, self.fused_cpu_ops):
            log.warning("fused CPU ops fall back to torch ops for this model: %s", self.fused_problem)
            self._fallback_logged = True
        tables = self.rope_tables(batch.positions)  # gathered once, shared by every layer
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, tables, kv, batch, backend)
        return self.head(self.norm(x[batch.logits_indices]), batch)


def layer_kinds(raw: dict[str, Any], pattern: int) -> tuple[str, ...]:
    """Each layer's kind: config.json's `layer_types`, else every `pattern`-th layer global (HF's rule)."""
    n = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
    if len(kinds) != n or any(k not in (SLIDING, GLOBAL) for k in kinds):
        raise ModelConfigError(f"layer_types must name {n} layers, each {SLIDING} or {GLOBAL}: {kinds}")
    return tuple(kinds)


def gemma_fields(arch: str, raw: dict[str, Any], max_positions: int, pattern: int) -> dict[str, Any]:
    """The `ModelConfig` fields Gemma 2 and 3 read alike (their HF defaults where config.json is silent)."""
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{arch} with use_bidirectional_attention is not supported (causal only)")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise ModelConfigError(f"{arch}: hidden_activation {act!r} is not supported (only {GELU_TANH})")
    window = raw.get("sliding_window", 4096)
    return {
        "head_dim": int(raw.get("head_dim") or 256),
        "max_position_embeddings": int(raw.get("max_position_embeddings", max_positions)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "sliding_window": int(window) if window else None,
        "extra": {
            "hidden_act": act,
            "layer_types": layer_kinds(raw, pattern),
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        },
    }


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's fields: soft-caps 50 (attention) and 30 (logits) unless config.json says otherwise."""
    out = gemma_fields(arch, raw, 8192, 2)
    out["extra"]["attn_softcap"] = raw.get("attn_logit_softcapping", 50.0)
    out["extra"]["final_softcap"] = raw.get("final_logit_softcapping", 30.0)
    return out


# llama.cpp's Gemma tensors under blk.N that differ from Llama's (its `ffn_norm` is the pre-MLP norm)
GGUF_LAYER_MODULES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def gguf_query_scalar(meta: GGUFMeta, layers_27b: int) -> float:
    """`query_pre_attn_scalar` as llama.cpp derives it (the file does not state it): hidden / heads for
    the 27B models (told apart by their layer count), the head dim otherwise."""
    heads, hidden = int(meta("attention.head_count", 1)), int(meta("embedding_length", 0))
    if int(meta("block_count", 0)) == layers_27b:
        return hidden / heads
    return float(meta("attention.key_length", hidden // heads))


def gguf_config(meta: GGUFMeta, vector: GGUFVector) -> dict[str, Any]:
    """What llama.cpp's converter writes for Gemma 2 beyond Llama's fields: the window and both caps."""
    return {
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "attn_logit_softcapping": meta("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": gguf_query_scalar(meta, 46),
    }


def gguf_tensor(key: str, w: torch.Tensor) -> torch.Tensor:
    """llama.cpp writes each Gemma RMSNorm weight as 1 + w: the checkpoint's w back."""
    return w - 1.0 if key.endswith("norm.weight") else w


FAMILY = ModelFamily(
    architectures=("Gemma2ForCausalLM",),
    build=Gemma2ForCausalLM,
    configure=configure,
    gguf_layer_modules=GGUF_LAYER_MODULES,
    gguf_config=gguf_config,
    gguf_tensor=gguf_tensor,
)
