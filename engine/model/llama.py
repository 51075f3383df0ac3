"""The Llama family: Llama, Mistral, Qwen2 and Qwen3, on the shared decoder (`engine/model/decoder.py`).

Their differences are configuration: Qwen2 adds q/k/v bias (and may tie the LM head to the embeddings),
Llama's and Qwen3's `attention_bias` a bias on q/k/v and o, Llama's `mlp_bias` one on gate/up/down,
Qwen3 adds RMSNorm on each head of q and k before RoPE, Llama 3 scales RoPE frequencies, Mistral has a
sliding window. Checkpoint names and LoRA targets are the Llama ones (`engine/model/family.py`).
"""

from __future__ import annotations

from typing import Any

from engine.model.decoder import DecoderForCausalLM
from engine.model.family import ModelFamily
from engine.model.layers import ForwardBatch, RMSNorm

__all__ = ["FAMILY", "ForwardBatch", "LlamaForCausalLM", "RMSNorm"]


class LlamaForCausalLM(DecoderForCausalLM):
    """The shared decoder as is."""


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's q/k/v bias by default, Llama's and Qwen3's `attention_bias` (q/k/v and o, as transformers
    builds them) and Llama's `mlp_bias`, Qwen3's q/k norm, Mistral's sliding window on by default."""
    out: dict[str, Any] = {}
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        out["o_bias"] = bool(raw.get("attention_bias", False))
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = bool(raw.get("mlp_bias", False))
    if arch == "Qwen2ForCausalLM":
        out["qkv_bias"] = bool(raw.get("attention_bias", True))
    if arch == "Qwen3ForCausalLM":
        out["qk_norm"] = True
    if arch == "MistralForCausalLM" and raw.get("use_sliding_window", True) and raw.get("sliding_window"):
        out["sliding_window"] = int(raw["sliding_window"])
    return out


FAMILY = ModelFamily(
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    build=LlamaForCausalLM,
    configure=configure,
    gguf_permuted=("LlamaForCausalLM", "MistralForCausalLM"),
)
