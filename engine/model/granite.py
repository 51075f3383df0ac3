"""IBM Granite (`GraniteForCausalLM`): Llama's blocks with four scalar multipliers.

- `embedding_multiplier`: the token embeddings are multiplied by it;
- `attention_multiplier`: the attention-logit scale (instead of head_dim^-0.5);
- `residual_multiplier`: each branch's output is multiplied by it before it is added to the residual;
- `logits_scaling`: the logits are divided by it.

Checkpoint names and LoRA targets are Llama's; so are GGUF files' (q/k rows permuted), with the four
multipliers in the metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.decoder import Attention, DecoderForCausalLM, DecoderLayer
from engine.model.family import GGUFMeta, GGUFVector, ModelFamily
from engine.model.layers import ForwardBatch
from engine.model.rope import RotaryEmbedding
from engine.model_config import ModelConfig, ModelConfigError


class GraniteDecoderLayer(DecoderLayer):
    """The shared layer with `residual_multiplier` and Granite's attention scale."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__(cfg, layer, rope)
        self.residual_multiplier = float(cfg.extra["residual_multiplier"])

    def make_attention(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> Attention:
        return Attention(cfg, layer, rope, scale=float(cfg.extra["attention_multiplier"]))


class GraniteForCausalLM(DecoderForCausalLM):
    """Scaled embeddings and logits around Granite's layers."""

    layer_cls = GraniteDecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embedding_multiplier = float(cfg.extra["embedding_multiplier"])
        self.logits_scaling = float(cfg.extra["logits_scaling"])

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.lookup(input_ids, batch) * self.embedding_multiplier

    def head(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """The LM head's logits divided by `logits_scaling` in the model's dtype (as HF), as float32."""
        return (self.logits(x, batch) / self.logits_scaling).float()


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The four multipliers (transformers' defaults: 1.0); biases on o/MLP projections are refused."""
    if raw.get("mlp_bias"):
        raise ModelConfigError("GraniteForCausalLM with mlp_bias is not supported")
    if raw.get("attention_bias"):
        raise ModelConfigError("GraniteForCausalLM with attention_bias is not supported")
    names = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
    return {"extra": {n: float(raw.get(n, 1.0)) for n in names}}


def gguf_config(meta: GGUFMeta, vector: GGUFVector) -> dict[str, Any]:
    """The multipliers as llama.cpp's converter writes them (`granite.embedding_scale`, …)."""
    keys = {
        "embedding_multiplier": "embedding_scale",
        "attention_multiplier": "attention.scale",
        "residual_multiplier": "residual_scale",
        "logits_scaling": "logit_scale",
    }
    return {name: float(meta(key, 1.0)) for name, key in keys.items()}


FAMILY = ModelFamily(
    architectures=("GraniteForCausalLM",),
    build=GraniteForCausalLM,
    configure=configure,
    gguf_permuted=("GraniteForCausalLM",),
    gguf_config=gguf_config,
)
