"""What a PEFT `adapter_config.json` may ask for, and which modules of the base model it targets.

`check_config` refuses unsupported settings (with the field named) and returns the rank/alpha rules;
`target_set` resolves `target_modules` / `layers_to_transform` / `exclude_modules` to the (layer,
projection) pairs and vocabulary modules of the model, as PEFT matches them (names of a mixture-of-experts
model's per-expert linears are left to `expert_checkpoint.py`); `refused_part` says why a family does not
adapt a module (`ModelFamily.lora_refused`: a mixture-of-experts model's router, shared expert, dense MLP).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.lora.adapter_error import AdapterError
from engine.lora.expert_targets import names_an_expert
from engine.model.family import LoRATarget
from engine.model.registry import model_family
from engine.model_config import ModelConfig

EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")


@dataclass(slots=True, frozen=True)
class AdapterRules:
    """The rank/alpha settings of a config: `r`, `lora_alpha`, per-module patterns, rsLoRA."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_dora: bool = False
    lora_bias: bool = False

    def rank_for(self, key: str) -> tuple[int, str]:
        """(rank, config field that set it) for module `key`, matched the PEFT way (first suffix match)."""
        pat = _pattern_key(self.rank_pattern, key)
        return (self.rank_pattern[pat], f"rank_pattern[{pat!r}]") if pat is not None else (self.r, "r")

    def alpha_for(self, key: str) -> float:
        pat = _pattern_key(self.alpha_pattern, key)
        return float(self.alpha_pattern[pat]) if pat is not None else self.alpha


def _pattern_key(patterns: dict[str, Any], key: str) -> str | None:
    """First pattern `p` such that `key` is `p` or ends with `.p` (`p` is a regex), as PEFT matches them."""
    for p in patterns:
        try:
            if re.match(rf"(.*\.)?({p})$", key):
                return p
        except re.error as exc:
            raise AdapterError(f"pattern {p!r}: invalid regex ({exc})") from exc
    return None


_REFUSED_FIELDS = {
    "layer_replication": "layer_replication is not supported",
    "ensure_weight_tying": "ensure_weight_tying (LoRA tied across embed_tokens, lm_head) is not supported",
}


def check_config(config: dict[str, Any]) -> AdapterRules:
    """Refuse unsupported settings and return the rank/alpha rules."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type: {peft_type!r} is not supported (only LORA)")
    flags = {}
    for flag in ("use_dora", "lora_bias"):
        value = config.get(flag, False)
        if not isinstance(value, bool):
            raise AdapterError(f"{flag}: expected true or false, got {value!r}")
        flags[flag] = value
    if flags["use_dora"] and flags["lora_bias"]:
        raise AdapterError("lora_bias: not supported together with use_dora (PEFT refuses the combination)")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"bias: {config['bias']!r} is not supported (only 'none')")
    for key, why in _REFUSED_FIELDS.items():
        if config.get(key):
            raise AdapterError(f"{key}: {config[key]!r}: {why}")
    r = config.get("r", 8)
    if not _is_int(r) or r < 1:
        raise AdapterError(f"r: expected a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise AdapterError(f"lora_alpha: expected a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"use_rslora: expected true or false, got {use_rslora!r}")
    patterns: list[dict[str, Any]] = []
    for key, check in (("rank_pattern", lambda v: _is_int(v) and v >= 1), ("alpha_pattern", _is_number)):
        value = config.get(key) or {}
        if not isinstance(value, dict):
            raise AdapterError(f"{key}: expected an object, got {type(value).__name__}")
        for k, v in value.items():
            if not check(v):
                raise AdapterError(f"{key}[{k!r}]: invalid value {v!r}")
        patterns.append(value)
    return AdapterRules(r, float(alpha), use_rslora, patterns[0], patterns[1], **flags)


def target_set(
    config: dict[str, Any], model: ModelConfig, modules: Mapping[str, LoRATarget]
) -> tuple[set[tuple[int, str]] | None, set[str] | None]:
    """The (layer, projection) pairs and the vocabulary modules (embed_tokens, lm_head) the config
    targets; (None, None) when it names no targets.

    `target_modules`: a list (a module is targeted when its full name equals an entry or ends with
    `.entry`, then filtered by `layers_to_transform`, which, as in PEFT, keeps modules named by their
    full key, such as `lm_head`, and drops the other layer-less ones, such as `model.embed_tokens` named
    `embed_tokens`), a regex (full match), or "all-linear" (projections only, as PEFT).
    `exclude_modules` (list or regex) removes modules. Other embedding names and names that match no
    module of the model are refused.
    """
    keys = {
        f"model.layers.{i}.{t.parent}.{p}": (i, p)
        for i in range(model.num_layers)
        for p, t in modules.items()
    }
    vocab_keys = {"model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}
    targets = config.get("target_modules")
    if targets is None:
        return None, None
    if targets == "all-linear":
        chosen = set(keys)
    elif isinstance(targets, str):
        try:
            rx = re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"target_modules: invalid regex {targets!r} ({exc})") from exc
        vocab_chosen = {k for k in vocab_keys if rx.fullmatch(k)}
        aliases = model_family(model.architecture).module_aliases
        chosen = {k for k in keys if any(rx.fullmatch(n) for n in (k, *aliases(model.architecture, k)))}
        chosen |= vocab_chosen
        if not chosen and not names_an_expert(model, targets, regex=True):
            raise AdapterError(f"target_modules: regex {targets!r} matches no supported projection")
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        chosen = set()
        # the checkpoint has modules beyond the served text layers (its names have aliases)
        outside = bool(keys) and bool(
            model_family(model.architecture).module_aliases(model.architecture, next(iter(keys)))
        )
        for t in targets:
            if t.split(".")[-1] in EMBEDDING_NAMES and t.split(".")[-1] not in vocab_keys.values():
                raise AdapterError(
                    f"target_modules: {t!r} is an embedding/lm_head target, which is not supported "
                    "(only embed_tokens and lm_head)"
                )
            hits = {k for k in vocab_keys if k == t or k.endswith("." + t)}
            if hits:
                chosen |= hits
                continue
            hits = {k for k in keys if k == t or k.endswith("." + t)}
            if not hits and names_an_expert(model, t):  # per-expert linears: `expert_checkpoint.py`
                continue
            refused = refused_part(model, t)
            if refused is not None:
                raise AdapterError(f"target_modules: {t!r} {refused}")
            if not hits and outside:  # e.g. `fc1` of a vision tower the engine does not serve
                continue
            if not hits:
                raise AdapterError(
                    f"target_modules: unknown module name {t!r} (supported: {', '.join(modules)})"
                )
            chosen |= hits
        layers = config.get("layers_to_transform")
        if layers is not None and layers != []:
            layers = [layers] if _is_int(layers) else layers
            if not isinstance(layers, list) or not all(_is_int(x) for x in layers):
                raise AdapterError(f"layers_to_transform: expected an int or a list of ints, got {layers!r}")
            for x in layers:
                if not 0 <= x < model.num_layers:
                    raise AdapterError(
                        f"layers_to_transform: layer {x} out of range (model has {model.num_layers})"
                    )
            # as PEFT: an entry naming a module's full key is kept whatever its layer (lm_head)
            chosen = {k for k in chosen if k in targets or (k in keys and keys[k][0] in layers)}
    else:
        raise AdapterError(
            f"target_modules: expected a list of names, a regex or 'all-linear', got {targets!r}"
        )
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str):
        names = model_family(model.architecture).module_aliases
        chosen = {
            k
            for k in chosen
            if not any(
                re.fullmatch(excluded, n) for n in ((k, *names(model.architecture, k)) if k in keys else (k,))
            )
        }
    elif isinstance(excluded, list):
        chosen = {k for k in chosen if not any(k == e or k.endswith("." + e) for e in excluded)}
    return {keys[k] for k in chosen if k in keys}, {vocab_keys[k] for k in chosen if k in vocab_keys}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def refused_part(model: ModelConfig, module: str) -> str | None:
    """Why the family does not adapt `module` (a target name or a module path), when a component of it
    (past `model.layers.N`) is one the family refuses (`ModelFamily.lora_refused`); else None."""
    refused = model_family(model.architecture).lora_refused
    parts = module.split(".")
    if parts[:2] == ["model", "layers"]:
        parts = parts[3:]
    return next((refused[p] for p in parts if p in refused), None)
