"""The side tensors of an adapter in an `UPLOAD` frame: what the other ranks need besides LoRA A and B.

Arrays, after the frame's A/B weights (`engine/distributed/step_plan.py`): a JSON header (uint8, UTF-8;
plain data, no pickle) naming what follows, then, float32 unless said:

- per adapted slice with a DoRA magnitude and/or a lora_B bias (header `slices`: [index into the
  frame's slices, has magnitude, has bias]): the magnitude [out], the bias [out], whole (each rank cuts
  its part, `engine/distributed/shard_adapters.py`);
- the embedding side of the adapter, which every rank applies to its own (replicated) embedding lookup:
  the embed_tokens LoRA (header `embed_lora`: rank, alpha, scaling; A [r, vocab], B [hidden, r]), the
  embed_tokens trainable tokens (header `embed_tokens`: their ids; the new rows [n, hidden]) and a
  `modules_to_save` copy of embed_tokens ([vocab, hidden]).

The LM-head side (lm_head LoRA, its trainable token rows, a saved lm_head) stays on rank 0, the only rank
that computes logits, so it is never sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from engine.lora.adapter_checkpoint import AdapterCheckpoint, LoRAModuleWeights
from engine.lora.vocab_checkpoint import SavedModule, TrainableTokens, VocabLoRAWeights

EMBED = "embed_tokens"


def _f32(t: torch.Tensor | None) -> np.ndarray:
    assert t is not None, "uploading an adapter needs its weights"
    return t.detach().float().cpu().numpy()


def encode_side(ckpt: AdapterCheckpoint, slices: Sequence[LoRAModuleWeights]) -> list[np.ndarray]:
    """The side arrays of `ckpt` (module docstring); `slices`: the frame's slices, in frame order."""
    head: dict[str, Any] = {"use_dora": ckpt.use_dora, "lora_bias": ckpt.lora_bias, "slices": []}
    arrays: list[np.ndarray] = []
    for i, w in enumerate(slices):
        if w.magnitude is not None or w.bias_b is not None:
            head["slices"].append([i, w.magnitude is not None, w.bias_b is not None])
            arrays += [_f32(t) for t in (w.magnitude, w.bias_b) if t is not None]
    for v in ckpt.vocab:
        if v.module == EMBED:
            head["embed_lora"] = [v.rank, v.alpha, v.scaling]
            arrays += [_f32(v.lora_a), _f32(v.lora_b)]
    for t in ckpt.tokens:
        if t.module == EMBED:
            head["embed_tokens"] = list(t.indices)
            arrays.append(_f32(t.values))
    for sm in ckpt.saved:
        if sm.module == EMBED:
            head["saved_embed"] = True
            arrays.append(_f32(sm.weight))
    raw = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
    return [raw, *arrays]


def decode_side(arrays: Sequence[np.ndarray], ckpt: AdapterCheckpoint) -> AdapterCheckpoint:
    """`ckpt` (decoded from the frame's A/B part) with the side tensors of `arrays` (`encode_side`)."""
    head = json.loads(bytes(arrays[0]).decode())
    rest: Iterator[torch.Tensor] = (torch.from_numpy(a) for a in arrays[1:])
    modules = list(ckpt.modules)
    for i, has_mag, has_bias in head["slices"]:
        mag = next(rest) if has_mag else None
        bias = next(rest) if has_bias else None
        modules[i] = replace(modules[i], magnitude=mag, bias_b=bias)
    vocab: tuple[VocabLoRAWeights, ...] = ()
    if "embed_lora" in head:
        rank, alpha, scaling = head["embed_lora"]
        a, b = next(rest), next(rest)
        vocab = (VocabLoRAWeights(EMBED, int(rank), float(alpha), float(scaling), a, b),)
    tokens: tuple[TrainableTokens, ...] = ()
    if "embed_tokens" in head:
        tokens = (TrainableTokens(EMBED, tuple(head["embed_tokens"]), next(rest)),)
    saved = (SavedModule(EMBED, next(rest)),) if head.get("saved_embed") else ()
    return replace(
        ckpt,
        modules=tuple(modules),
        use_dora=bool(head["use_dora"]),
        lora_bias=bool(head["lora_bias"]),
        vocab=vocab,
        tokens=tokens,
        saved=saved,
    )
