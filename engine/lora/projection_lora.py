"""One module's LoRA, validated from its tensors: a projection's (split into the engine's slices) or an
embed_tokens / lm_head one. Both check that A and B (and what the config adds: DoRA's magnitude, lora_bias)
are all there, that the rank is within `max_lora_rank`, the shapes fit the base model and the weights are
finite, and compute the scaling `alpha / rank` (`alpha / sqrt(rank)` with rsLoRA).

`slot` maps a tensor kind ("A", "B", "b" for lora_B's bias, "M" for DoRA's magnitude; "base" for a vocab
module's base-layer tensor) to its name in the safetensors file; `header` maps names to (dtype, shape).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.lora.adapter_error import AdapterError
from engine.lora.adapter_rules import AdapterRules
from engine.lora.adapter_weights import LoRAModuleWeights, module_features, target_features
from engine.lora.vocab_checkpoint import VocabLoRAWeights, vocab_shape
from engine.model.family import LoRATarget
from engine.model_config import ModelConfig

Header = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(slots=True, frozen=True)
class TensorSource:
    """What every module's LoRA is read from and checked against: the file's `header`, its `tensors`
    (empty when `load_weights` is off: then only names and shapes are checked), the config's `rules`,
    the base `model` and the engine's `max_lora_rank`."""

    header: Header
    tensors: dict[str, torch.Tensor]
    rules: AdapterRules
    model: ModelConfig
    max_lora_rank: int
    load_weights: bool


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's LoRA scaling: `alpha / sqrt(rank)` with rsLoRA, else `alpha / rank`."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def check_shape(name: str, entry: tuple[str, tuple[int, ...]], want: tuple[int, ...], module: str) -> None:
    """`AdapterError` unless the header entry (dtype, shape) of tensor `name` has the shape `want`."""
    shape = entry[1]
    if shape != want:
        raise AdapterError(
            f"tensor {name!r}: shape {list(shape)} does not fit the base model's {module} "
            f"(expected {list(want)})"
        )


def check_finite(names: Iterable[str], tensors: dict[str, torch.Tensor]) -> None:
    """`AdapterError` naming the first of the tensors `names` with a NaN or Inf value."""
    for name in names:
        if not torch.isfinite(tensors[name]).all():
            raise AdapterError(f"tensor {name!r}: contains NaN or Inf values")


def projection_weights(
    layer: int, module: str, target: LoRATarget, slot: dict[str, str], src: TensorSource
) -> list[LoRAModuleWeights]:
    """The validated LoRA of the family's target `module` in `layer`, one entry per engine slice of the
    target: a fused target's B rows (and magnitude, bias) are one block per slice, in order."""
    header, tensors, rules, model = src.header, src.tensors, src.rules, src.model
    for ab in "AB" + ("M" if rules.use_dora else "") + ("b" if rules.lora_bias else ""):
        if ab not in slot:
            other = next(iter(slot.values()))
            what = {"M": "use_dora: DoRA's lora_magnitude_vector", "b": "lora_bias: its lora_B bias"}
            raise AdapterError(f"tensor {other!r}: {what.get(ab, f'its lora_{ab}')} partner is missing")
    key = f"model.layers.{layer}.{target.parent}.{module}"
    rank, r_field = rules.rank_for(key)
    alpha = rules.alpha_for(key)
    if rank > src.max_lora_rank:
        raise AdapterError(
            f"{r_field}: rank {rank} of layer {layer} {module} exceeds max_lora_rank {src.max_lora_rank}"
        )
    in_f, out_f = target_features(model, target)
    check_shape(slot["A"], header[slot["A"]], (rank, in_f), module)
    check_shape(slot["B"], header[slot["B"]], (out_f, rank), module)
    for vec in "Mb":
        if vec in slot:
            check_shape(slot[vec], header[slot[vec]], (out_f,), module)
    a = b = mag = bias_b = None
    if src.load_weights:
        a, b = tensors[slot["A"]], tensors[slot["B"]]
        mag, bias_b = tensors.get(slot.get("M", "")), tensors.get(slot.get("b", ""))
        check_finite(slot.values(), tensors)
    scaling = lora_scaling(alpha, rank, rules.use_rslora)
    out, row = [], 0
    for piece in target.slices:
        width = module_features(model, piece)[1]
        rows = slice(row, row + width)
        b_rows = None if b is None else b[rows]
        m_rows = None if mag is None else mag[rows]
        bias_rows = None if bias_b is None else bias_b[rows]
        out.append(LoRAModuleWeights(layer, piece, rank, alpha, scaling, a, b_rows, m_rows, bias_rows))
        row += width
    return out


def vocab_weights(module: str, slot: dict[str, str], src: TensorSource) -> VocabLoRAWeights:
    """The validated LoRA of `module` (embed_tokens / lm_head) from its tensors `slot` (kind -> name)."""
    header, tensors, rules, model = src.header, src.tensors, src.rules, src.model
    for ab in "AB":
        if ab not in slot:
            raise AdapterError(
                f"tensor {next(iter(slot.values()))!r}: its {module} lora_{ab} partner is missing"
            )
    key = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
    rank, r_field = rules.rank_for(key)
    if rank > src.max_lora_rank:
        raise AdapterError(f"{r_field}: rank {rank} of {module} exceeds max_lora_rank {src.max_lora_rank}")
    for kind, name in slot.items():
        check_shape(name, header[name], vocab_shape(model, module, kind, rank), module)
    a = b = None
    if src.load_weights:
        a, b = tensors[slot["A"]], tensors[slot["B"]]
        check_finite((slot["A"], slot["B"]), tensors)
    alpha = rules.alpha_for(key)
    return VocabLoRAWeights(module, rank, alpha, lora_scaling(alpha, rank, rules.use_rslora), a, b)
