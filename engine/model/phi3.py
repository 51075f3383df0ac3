"""The Phi-3 family (`Phi3ForCausalLM`: Phi-3, Phi-3.5, Phi-4, Phi-4-mini): Llama's blocks, fused weights.

- The checkpoint stores q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`: they fill the
  engine's packed projections whole. PEFT adapters target those fused modules; their lora_B rows split
  across the engine's q, k, v (gate, up) slices (`engine/lora/adapter_checkpoint.py`).
- `partial_rotary_factor` (Phi-4-mini: 0.75): RoPE on the leading part of each head (`rope.py`).
- LongRoPE (`rope_scaling` type `longrope`, older names `su` and `yarn`): short and long factors chosen by
  length as transformers does, with its attention factor (`rope.py`).
- A `sliding_window` in the config: every layer attends to its last `sliding_window` positions, as in
  transformers (the shared attention's window, `engine/attention/backend.py`).
- GGUF files (`phi3`): fused `attn_qkv` / `ffn_up` tensors, unpermuted; partial rotary, the window and
  LongRoPE's factors from the metadata (`gguf_config`).
"""

from __future__ import annotations

from typing import Any

from engine.model.decoder import DecoderForCausalLM
from engine.model.family import GGUFMeta, GGUFVector, LoRATarget, ModelFamily
from engine.model_config import ModelConfigError


class Phi3ForCausalLM(DecoderForCausalLM):
    """The shared decoder as is (partial rotary and LongRoPE are the shared RoPE's)."""


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary, LongRoPE's parameters (the top-level `original_max_position_embeddings` first,
    as transformers) and the sliding window; `ModelConfigError` for LongRoPE without its factor lists."""
    rope = dict(raw.get("rope_parameters") or {}) | dict(raw.get("rope_scaling") or {})
    factor = raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    out: dict[str, Any] = {"extra": {"partial_rotary_factor": float(factor)}}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su", "yarn"):
        orig = raw.get("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
        missing = [k for k in ("short_factor", "long_factor") if not isinstance(rope.get(k), list)]
        if orig is None or missing:
            raise ModelConfigError(
                "longrope scaling needs short_factor, long_factor and original_max_position_embeddings"
            )
        heads = int(raw.get("num_attention_heads") or 1)
        head_dim = int(raw.get("head_dim") or int(raw.get("hidden_size") or 0) // heads)
        want = int(head_dim * float(factor)) // 2
        for key in ("short_factor", "long_factor"):
            if len(rope[key]) != want:
                raise ModelConfigError(f"longrope {key} has {len(rope[key])} values, expected {want}")
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [float(x) for x in rope["short_factor"]],
            "long_factor": [float(x) for x in rope["long_factor"]],
            "factor": rope.get("factor"),
            "attention_factor": rope.get("attention_factor"),
            "original_max_position_embeddings": int(orig),
            "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        }
    if raw.get("sliding_window"):
        out["sliding_window"] = int(raw["sliding_window"])
    return out


def gguf_config(meta: GGUFMeta, vector: GGUFVector) -> dict[str, Any]:
    """What llama.cpp's converter writes beyond Llama's fields: the rotary dims (partial rotary), the
    sliding window (0: none), and for LongRoPE the `rope_factors_short`/`_long` tensors with the
    original context length and attention factor."""
    heads, hidden = int(meta("attention.head_count", 1)), int(meta("embedding_length", 0))
    head_dim = int(meta("attention.key_length", hidden // heads))
    out: dict[str, Any] = {"partial_rotary_factor": int(meta("rope.dimension_count", head_dim)) / head_dim}
    if meta("attention.sliding_window", 0):
        out["sliding_window"] = int(meta("attention.sliding_window", 0))
    short, long = vector("rope_factors_short.weight"), vector("rope_factors_long.weight")
    if short is not None and long is not None:
        out["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length", 0))
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": short,
            "long_factor": long,
            "attention_factor": meta("rope.scaling.attn_factor", None),
        }
    return out


FAMILY = ModelFamily(
    architectures=("Phi3ForCausalLM",),
    build=Phi3ForCausalLM,
    configure=configure,
    rope_types=("longrope", "su", "yarn"),
    checkpoint_modules={
        "self_attn.qkv_proj": ("self_attn.qkv_proj", None),
        "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
    },
    lora_targets={
        "qkv_proj": LoRATarget("self_attn", ("q_proj", "k_proj", "v_proj")),
        "o_proj": LoRATarget("self_attn", ("o_proj",)),
        "gate_up_proj": LoRATarget("mlp", ("gate_proj", "up_proj")),
        "down_proj": LoRATarget("mlp", ("down_proj",)),
    },
    gguf_layer_modules={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    gguf_config=gguf_config,
)
