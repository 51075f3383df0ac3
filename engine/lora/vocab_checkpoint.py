"""Embedding and LM-head LoRA in a PEFT checkpoint: tensor names, expected shapes, the weights' record.

PEFT's `Embedding` LoRA on `embed_tokens` stores `lora_embedding_A` [r, vocab] and `lora_embedding_B`
[hidden, r]; per token t its output is `E[t] + s · (A[:, t] @ B.T)`. A LoRA on `lm_head` is an ordinary
`Linear` LoRA: `lora_A.weight` [r, hidden], `lora_B.weight` [vocab, r], adding `s · (h @ A.T) @ B.T` to
the logits. With `save_embedding_layers` (PEFT's default when these are targeted) the checkpoint also
holds the base layers' weights (`…embed_tokens.base_layer.weight`, `…lm_head.base_layer.weight`);
they are frozen copies of the base model's, so they are shape-checked and not used.

With tied embeddings (Qwen2's small models) the two LoRAs stay independent, as in PEFT without
`ensure_weight_tying`; that option (which ties the adapters too) is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig

# PEFT module name -> the engine's checkpoint key of its base weight (without ".weight")
VOCAB_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}

_VOCAB_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?:lora_embedding_(?P<eab>[AB])(?:\.[^.]+)?|lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight|base_layer\.weight)$"
)


@dataclass(slots=True, frozen=True)
class VocabLoRAWeights:
    """The LoRA of `embed_tokens` or `lm_head` (see the module docstring for the shapes)."""

    module: str  # "embed_tokens" | "lm_head"
    rank: int
    alpha: float
    scaling: float
    lora_a: torch.Tensor | None  # embed_tokens: [r, vocab]; lm_head: [r, hidden] (None: not loaded)
    lora_b: torch.Tensor | None  # embed_tokens: [hidden, r]; lm_head: [vocab, r]


def vocab_tensor(name: str, engine_key: str | None) -> tuple[str, str] | None:
    """(module, kind) of an embed_tokens / lm_head tensor, kind "A", "B" or "base"; None for others.

    `engine_key`: the family's engine name of the tensor's module (`checkpoint_key`, without
    ".weight"), so a family that names its embeddings differently maps onto the same two modules."""
    m = _VOCAB_RE.match(name)
    if m is None or engine_key is None:
        return None
    module = next((k for k, v in VOCAB_MODULES.items() if engine_key == v), None)
    if module is None:
        return None
    if m["eab"] is not None and module != "embed_tokens":
        return None
    if m["ab"] is not None and module != "lm_head":
        return None
    return module, m["eab"] or m["ab"] or "base"


def vocab_shape(model: ModelConfig, module: str, kind: str, rank: int) -> tuple[int, int]:
    """The shape a tensor of kind A / B / base of `module` must have against `model`."""
    vocab, hidden = model.vocab_size, model.hidden_size
    if kind == "base":
        return (vocab, hidden)
    if module == "embed_tokens":
        return (rank, vocab) if kind == "A" else (hidden, rank)
    return (rank, hidden) if kind == "A" else (vocab, rank)
