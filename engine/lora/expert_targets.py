"""Which parts of a mixture-of-experts model an adapter's config names for LoRA on the routed experts:
the sparse layers, PEFT's `target_parameters` resolved to the experts' fused parameters (anything else
refused, naming it), and `target_modules` / `layers_to_transform` / `exclude_modules` selecting per-expert
linears as PEFT matches them. Read by `expert_checkpoint.py` and `adapter_rules.py`."""

from __future__ import annotations

import re
from typing import Any

from engine.lora.adapter_error import AdapterError
from engine.model_config import ModelConfig

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused experts' parameters, in registration order
# per-expert linears -> (our projection, half of gate|up: 0 gate, 1 up, None: down)
PER_EXPERT_NAMES = {
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", None),
    "w1": ("gate_up", 0),
    "w3": ("gate_up", 1),
    "w2": ("down", None),
}


def expert_features(model: ModelConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of one expert's projection `proj` ("gate_up" or "down")."""
    hidden, inter = model.hidden_size, int(model.extra["moe"]["intermediate_size"])
    return (hidden, 2 * inter) if proj == "gate_up" else (inter, hidden)


def sparse_layers(model: ModelConfig) -> list[int]:
    """The layers with routed experts (`engine.model.moe.is_sparse_layer`'s rule), none without MoE."""
    moe = model.extra.get("moe")
    if not moe:
        return []
    step, dense = int(moe.get("decoder_sparse_step", 1)), set(moe.get("mlp_only_layers", ()))
    return [i for i in range(model.num_layers) if i not in dense and (i + 1) % step == 0]


def names_an_expert(model: ModelConfig, target: str, regex: bool = False) -> bool:
    """Whether the `target_modules` entry `target` (a name, or with `regex` a pattern) selects per-expert
    linears of `model` (`experts.N.gate_proj` ..., Mixtral's `block_sparse_moe.experts.N.w1` ...)."""
    layers = sparse_layers(model)
    if not layers:
        return False
    if not regex:
        parts = target.split(".")
        return parts[-1] in PER_EXPERT_NAMES and not {"gate", "shared_expert"} & set(parts[:-1])
    e = int(model.extra["moe"]["num_experts"])
    return any(
        re.fullmatch(target, f"model.layers.{layer}.{parent}.experts.{x}.{p}")
        for layer in layers
        for parent in ("mlp", "block_sparse_moe")
        for x in range(e)
        for p in PER_EXPERT_NAMES
    )


def matches(name: str, entry: str) -> bool:
    return name == entry or name.endswith("." + entry)


def parameter_targets(config: dict[str, Any], model: ModelConfig) -> dict[int, list[str]]:
    """Per sparse layer, the expert parameters `target_parameters` names (in registration order); refuses
    entries that name anything else, naming them."""
    entries = config.get("target_parameters") or []
    if not entries:
        return {}
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise AdapterError(f"target_parameters: expected a list of parameter names, got {entries!r}")
    layers = sparse_layers(model)
    if not layers:
        raise AdapterError(
            f"target_parameters: {entries!r}: LoRA on raw parameters is supported only on the experts of a "
            "mixture-of-experts model"
        )
    out: dict[int, list[str]] = {}
    for entry in entries:
        hit = False
        for layer in layers:
            for p in EXPERT_PARAMS:
                if matches(f"model.layers.{layer}.mlp.experts.{p}", entry):
                    out.setdefault(layer, [])
                    if p not in out[layer]:
                        out[layer].append(p)
                    hit = True
        if not hit:
            what = "the router" if entry.split(".")[-2:-1] == ["gate"] or entry == "gate.weight" else entry
            raise AdapterError(
                f"target_parameters: {entry!r}: LoRA on {what} is not supported (only the experts' "
                f"{' and '.join(f'mlp.experts.{p}' for p in EXPERT_PARAMS)})"
            )
    return {layer: [p for p in EXPERT_PARAMS if p in ps] for layer, ps in out.items()}


def module_selected(config: dict[str, Any], module: str, layer: int, model: ModelConfig) -> bool:
    """Whether PEFT's `target_modules` / `layers_to_transform` / `exclude_modules` select the per-expert
    linear `module` (its name in the adapter's checkpoint)."""
    targets = config.get("target_modules")
    if targets is None or targets == "all-linear":
        chosen = True
    elif isinstance(targets, str):
        chosen = re.fullmatch(targets, module) is not None
    else:
        chosen = any(matches(module, t) for t in targets)
    layers = config.get("layers_to_transform")
    if chosen and layers not in (None, []) and not isinstance(targets, str):
        chosen = layer in ([layers] if isinstance(layers, int) else layers)
    excluded = config.get("exclude_modules")
    if chosen and isinstance(excluded, str):
        chosen = re.fullmatch(excluded, module) is None
    elif chosen and isinstance(excluded, list):
        chosen = not any(matches(module, e) for e in excluded)
    return chosen
