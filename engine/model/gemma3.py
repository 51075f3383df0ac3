"""The Gemma 3 family, text only: `Gemma3ForCausalLM`, and the language model inside
`Gemma3ForConditionalGeneration` checkpoints (the vision tower and projector are skipped), exactly as
transformers 5 computes it.

Gemma 2's blocks (`engine/model/gemma2.py`) plus:
- RMSNorm (1 + w) of each q and k head before RoPE (`q_norm`, `k_norm`);
- local (sliding-window) and global layers 5:1 (`layer_types`, else `sliding_window_pattern` = 6), each
  kind with its own RoPE: local layers `rope_local_base_freq` (10k) unscaled, global layers `rope_theta`
  (1M) with the long-context variants' `rope_scaling` (linear: positions / factor);
- no attention soft-capping (transformers' Gemma 3 attention ignores `attn_logit_softcapping`), the final
  logits soft-capped only when `final_logit_softcapping` is set.

config.json in transformers 5 nests RoPE per layer kind (`rope_parameters.sliding_attention` /
`.full_attention`); 4.x checkpoints spell it `rope_theta`, `rope_local_base_freq`, `rope_scaling`.
A `Gemma3ForConditionalGeneration` config holds the text model in `text_config`, often only the fields
that differ from `Gemma3TextConfig`'s defaults, which `normalize` fills in.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.decoder import Attention
from engine.model.family import GGUFMeta, GGUFVector, ModelFamily
from engine.model.gemma2 import (
    GGUF_LAYER_MODULES,
    GLOBAL,
    SLIDING,
    Gemma2ForCausalLM,
    GemmaDecoderLayer,
    GemmaRMSNorm,
    gemma_fields,
    gguf_query_scalar,
    gguf_tensor,
)
from engine.model.rope import RotaryEmbedding, rotary_dim
from engine.model_config import ModelConfig, ModelConfigError

CONDITIONAL = "Gemma3ForConditionalGeneration"

# Gemma3TextConfig's defaults (transformers 5), for the fields a multimodal checkpoint's text_config omits
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}


class Gemma3DecoderLayer(GemmaDecoderLayer):
    """Gemma's layer with (1 + w) RMSNorm on each q and k head (`cfg.qk_norm`)."""

    def make_attention(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> Attention:
        attn = super().make_attention(cfg, layer, rope)
        attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # type: ignore[assignment]
        attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # type: ignore[assignment]
        return attn


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model with q/k norms and a second RoPE table set for the local layers."""

    layer_cls = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)  # `self.rope`: the global layers' tables
        theta, scaling = cfg.extra["local_rope"]
        self.rope_local = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, theta, scaling, rotary_dim(cfg))
        for layer in self.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            if layer.kind == SLIDING:
                layer.self_attn.rope = self.rope_local

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {SLIDING: self.rope_local.tables(positions), GLOBAL: self.rope.tables(positions)}


def _rope(params: dict[str, Any], what: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, rope_scaling or None) of one layer kind's RoPE parameters."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(params["rope_theta"]), None
    if kind != "linear":
        raise ModelConfigError(f"Gemma 3 {what} rope scaling {kind!r} is not supported (default, linear)")
    return float(params["rope_theta"]), {"rope_type": "linear", "factor": float(params["factor"])}


def normalize(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """A `Gemma3ForConditionalGeneration` config's text model as a top-level config (with
    Gemma3TextConfig's defaults for what it omits); a `Gemma3ForCausalLM` config as it is."""
    if arch != CONDITIONAL:
        return raw
    text = TEXT_DEFAULTS | dict(raw.get("text_config") or {})
    dtype = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return text | {"architectures": [CONDITIONAL], "dtype": dtype or "float32"}


def configure(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields: q/k norm, the two RoPEs, the final soft-cap only if given."""
    out = gemma_fields(arch, raw, 131_072, int(raw.get("sliding_window_pattern", 6)))
    nested = raw.get("rope_parameters")
    if isinstance(nested, dict) and (GLOBAL in nested or SLIDING in nested):  # transformers 5
        global_rope = dict(nested.get(GLOBAL) or {})
        local_rope = dict(nested.get(SLIDING) or {})
    else:  # transformers 4.x
        global_rope = dict(raw.get("rope_scaling") or {})
        global_rope.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local_rope = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    global_rope.setdefault("rope_theta", 1_000_000.0)
    local_rope.setdefault("rope_theta", 10_000.0)
    out["rope_theta"], out["rope_scaling"] = _rope(global_rope, "global")
    out["qk_norm"] = True
    out["extra"]["local_rope"] = _rope(local_rope, "local")
    out["extra"]["final_softcap"] = raw.get("final_logit_softcapping")
    return out


def checkpoint_key(key: str) -> str | None:
    """A tensor name of either checkpoint as `Gemma3ForCausalLM`'s, or None (vision tower, projector):
    transformers 5 saves the text model as `model.language_model.*`, 4.x as `language_model.model.*`."""
    for prefix in ("model.language_model.", "language_model.model."):
        if key.startswith(prefix):
            return "model." + key.removeprefix(prefix)
    if key == "language_model.lm_head.weight":
        return "lm_head.weight"
    if key.startswith(("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.")):
        return None
    if key.startswith("multi_modal_projector."):
        return None
    return key


def gguf_config(meta: GGUFMeta, vector: GGUFVector) -> dict[str, Any]:
    """What llama.cpp's converter writes for Gemma 3 (`gemma3`): the window, the global RoPE's linear
    scaling, an optional final soft-cap; the local RoPE base (10k) and the 5:1 pattern are llama.cpp's
    constants unless the file states a pattern."""
    pattern = meta("attention.sliding_window_pattern", 6)  # a period, or one flag per layer (True: local)
    out: dict[str, Any] = {
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "rope_local_base_freq": 10_000.0,
        "final_logit_softcapping": meta("final_logit_softcapping", None),
        "query_pre_attn_scalar": gguf_query_scalar(meta, 62),
    }
    if isinstance(pattern, list):
        out["layer_types"] = [SLIDING if flag else GLOBAL for flag in pattern]
    else:
        out["sliding_window_pattern"] = int(pattern)
    if meta("rope.scaling.type", None) == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor", 1.0))}
    return out


def module_aliases(arch: str, module: str) -> tuple[str, ...]:
    """A text layer's module as `Gemma3ForConditionalGeneration` names it (transformers 5, then 4.x)."""
    if arch != CONDITIONAL:
        return ()
    rest = module.removeprefix("model.")
    return f"model.language_model.{rest}", f"language_model.model.{rest}"


FAMILY = ModelFamily(
    architectures=("Gemma3ForCausalLM", CONDITIONAL),
    build=Gemma3ForCausalLM,
    configure=configure,
    rope_types=("linear",),
    normalize=normalize,
    checkpoint_key=checkpoint_key,
    module_aliases=module_aliases,
    gguf_layer_modules=GGUF_LAYER_MODULES,
    gguf_config=gguf_config,
    gguf_tensor=gguf_tensor,
)
