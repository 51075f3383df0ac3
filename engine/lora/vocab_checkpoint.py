"""Embedding and LM-head LoRA in a PEFT checkpoint: tensor names, expected shapes, the weights' record.

PEFT's `Embedding` LoRA on `embed_tokens` stores `lora_embedding_A` [r, vocab] and `lora_embedding_B`
[hidden, r]; per token t its output is `E[t] + s · (A[:, t] @ B.T)`. A LoRA on `lm_head` is an ordinary
`Linear` LoRA: `lora_A.weight` [r, hidden], `lora_B.weight` [vocab, r], adding `s · (h @ A.T) @ B.T` to
the logits. With `save_embedding_layers` (PEFT's default when these are targeted) the checkpoint also
holds the base layers' weights (`…embed_tokens.base_layer.weight`, `…lm_head.base_layer.weight`);
they are frozen copies of the base model's, so they are shape-checked and not used.

With tied embeddings (Qwen2's small models) the two LoRAs stay independent, as in PEFT without
`ensure_weight_tying`; that option (which ties the adapters too) is refused.

Trainable tokens (`trainable_token_indices`: a list of token ids for the input embedding, or a dict
{module: ids}) store `…<module>.token_adapter.trainable_tokens_delta` [n, hidden]: despite the name, the
new rows themselves, which replace rows `ids` of that module's weight (PEFT's `TrainableTokensLayer`).
With tied embeddings the LM head follows the embedding's new rows (PEFT ties the head to the token
adapter) unless the checkpoint has the head's own rows; untied, only what is listed changes.

`modules_to_save` (embed_tokens and/or lm_head, by their family names) stores a whole trained copy of the
module's weight as `base_model.model.<module path>.weight` [vocab, hidden] (PEFT's `ModulesToSaveWrapper`,
the adapter-name infix dropped on save): that adapter's tokens look up its own embedding matrix and its
logits come from its own head. With tied embeddings each saved copy replaces only its own module, as in
PEFT (saving just `embed_tokens` leaves the head on the base matrix). The vocabulary must be the base
model's (a resized vocabulary is refused), and an entry that saves any other module is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from engine.lora.adapter_error import AdapterError
from engine.model_config import ModelConfig

# PEFT module name -> the engine's checkpoint key of its base weight (without ".weight")
VOCAB_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}

_VOCAB_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?:lora_embedding_(?P<eab>[AB])(?:\.[^.]+)?|lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight|base_layer\.weight)$"
)

# a tensor of an adapter layer (not a saved module's plain weight)
_ADAPTER_PART_RE = re.compile(r"\.(?:lora_|base_layer\.|token_adapter\.|original_module\.)")

_TOKENS_RE = re.compile(r"^(?:base_model\.model\.)?.+?\.token_adapter\.trainable_tokens_delta(?:\.[^.]+)?$")


@dataclass(slots=True, frozen=True)
class TrainableTokens:
    """New rows of `module`'s weight (embed_tokens: the lookups; lm_head: the logits columns)."""

    module: str  # "embed_tokens" | "lm_head"
    indices: tuple[int, ...]
    values: torch.Tensor | None  # [len(indices), hidden] (None: not loaded)


@dataclass(slots=True, frozen=True)
class VocabLoRAWeights:
    """The LoRA of `embed_tokens` or `lm_head` (see the module docstring for the shapes)."""

    module: str  # "embed_tokens" | "lm_head"
    rank: int
    alpha: float
    scaling: float
    lora_a: torch.Tensor | None  # embed_tokens: [r, vocab]; lm_head: [r, hidden] (None: not loaded)
    lora_b: torch.Tensor | None  # embed_tokens: [hidden, r]; lm_head: [vocab, r]


@dataclass(slots=True, frozen=True)
class SavedModule:
    """A `modules_to_save` copy of `module`'s whole weight (embed_tokens: lookups; lm_head: logits)."""

    module: str  # "embed_tokens" | "lm_head"
    weight: torch.Tensor | None  # [vocab, hidden] (None: not loaded)


def saved_copies(
    config: dict[str, Any], names: Iterable[str], checkpoint_key: Callable[[str], str | None]
) -> dict[str, tuple[str, str]]:
    """{module: (tensor name, module path)} of the checkpoint's `modules_to_save` copies of embed_tokens /
    lm_head: plain `<module path>.weight` tensors whose path ends with a `modules_to_save` entry (PEFT's
    match), mapped to the engine's modules through the family's `checkpoint_key`.

    Refuses, naming the entry, one that saves anything else (a norm, a classifier) or nothing."""
    raw = config.get("modules_to_save") or []
    if not isinstance(raw, list) or not all(isinstance(e, str) for e in raw):
        raise AdapterError("modules_to_save: expected a list of module names")
    plain = {
        n.removeprefix("base_model.model.").removesuffix(".weight"): n
        for n in names
        if n.endswith(".weight") and not _ADAPTER_PART_RE.search(n)
    }
    out: dict[str, tuple[str, str]] = {}
    for i, entry in enumerate(raw):
        paths = [p for p in plain if p.endswith(entry)]
        if not paths:
            raise AdapterError(f"modules_to_save[{i}]: {entry!r} has no saved weight in the checkpoint")
        for path in paths:
            key = checkpoint_key(f"{path}.weight")
            module = next((k for k, v in VOCAB_MODULES.items() if key == f"{v}.weight"), None)
            if module is None:
                raise AdapterError(
                    f"modules_to_save[{i}]: {entry!r} is not supported (only embed_tokens and lm_head; "
                    f"it saves {path})"
                )
            if module in out and out[module][1] != path:
                raise AdapterError(f"modules_to_save[{i}]: a second saved copy of {module} ({path})")
            out[module] = (plain[path], path)
    for path, name in plain.items():
        key = checkpoint_key(f"{path}.weight")
        module = next((k for k, v in VOCAB_MODULES.items() if key == f"{v}.weight"), None)
        if module is not None and module not in out:
            raise AdapterError(f"tensor {name!r}: a saved copy of {module}, not in modules_to_save")
    return out


def saved_modules(
    found: dict[str, tuple[str, str]],
    header: dict[str, tuple[str, tuple[int, ...]]],
    tensors: dict[str, torch.Tensor],
    model: ModelConfig,
    load_weights: bool,
) -> tuple[SavedModule, ...]:
    """The `modules_to_save` copies `found` (`saved_copies`), shape-checked against `model` (a resized
    vocabulary is refused) and with their weights when `load_weights`."""
    out: list[SavedModule] = []
    for module in ("embed_tokens", "lm_head"):
        if module not in found:
            continue
        name = found[module][0]
        shape, want = header[name][1], (model.vocab_size, model.hidden_size)
        if shape != want:
            raise AdapterError(
                f"tensor {name!r}: shape {list(shape)} does not fit the base model's {module} "
                f"(expected {list(want)}; a resized vocabulary is not supported)"
            )
        weight = tensors[name] if load_weights else None
        if weight is not None and not torch.isfinite(weight).all():
            raise AdapterError(f"tensor {name!r}: contains NaN or Inf values")
        out.append(SavedModule(module, weight))
    return tuple(out)


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


def token_tensor(name: str, engine_key: str | None) -> str | None:
    """The module ("embed_tokens" | "lm_head") of a trainable-tokens tensor; None for other tensors."""
    if _TOKENS_RE.match(name) is None:
        return None
    module = next((k for k, v in VOCAB_MODULES.items() if engine_key == v), None)
    if module is None:
        raise AdapterError(f"tensor {name!r}: trainable tokens of a module other than embed_tokens/lm_head")
    return module


def _token_indices(config: dict[str, Any], model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{module: token ids} of `trainable_token_indices` (a list: embed_tokens), checked against `model`."""
    raw = config.get("trainable_token_indices")
    if raw is None or raw == [] or raw == {}:
        return {}
    field = "trainable_token_indices"
    if isinstance(raw, list):
        raw = {"embed_tokens": raw}
    if not isinstance(raw, dict):
        raise AdapterError(f"{field}: expected a list of token ids or an object, got {type(raw).__name__}")
    out: dict[str, tuple[int, ...]] = {}
    for key, ids in raw.items():
        module = str(key).split(".")[-1]
        if module not in VOCAB_MODULES:
            raise AdapterError(f"{field}[{key!r}]: only embed_tokens and lm_head are supported")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise AdapterError(f"{field}[{key!r}]: expected a list of token ids")
        bad = [i for i in ids if not 0 <= i < model.vocab_size]
        if bad:
            raise AdapterError(
                f"{field}[{key!r}]: token id {bad[0]} out of range (vocabulary of {model.vocab_size})"
            )
        if len(set(ids)) != len(ids):
            raise AdapterError(f"{field}[{key!r}]: duplicate token ids")
        out[module] = tuple(ids)
    return out


def trainable_tokens(
    config: dict[str, Any],
    names: dict[str, str],
    header: dict[str, tuple[str, tuple[int, ...]]],
    tensors: dict[str, torch.Tensor],
    model: ModelConfig,
    load_weights: bool,
) -> tuple[TrainableTokens, ...]:
    """The checkpoint's trainable tokens (see the module docstring): per module with rows in the file,
    plus, with tied embeddings, the head following the embedding's rows when it has none of its own."""
    wanted = _token_indices(config, model)
    for module, name in names.items():
        if module not in wanted:
            raise AdapterError(
                f"tensor {name!r}: trainable tokens of {module}, not in trainable_token_indices"
            )
    out: list[TrainableTokens] = []
    for module, ids in wanted.items():
        found = names.get(module)
        if found is None:
            if module == "lm_head" and model.tie_word_embeddings and wanted.get("embed_tokens") == ids:
                continue  # tied to the embedding's rows (PEFT saves them once)
            raise AdapterError(f"trainable_token_indices[{module!r}]: its trainable_tokens_delta is missing")
        shape = header[found][1]
        if shape != (len(ids), model.hidden_size):
            raise AdapterError(
                f"tensor {found!r}: shape {list(shape)} does not fit {len(ids)} tokens of the base model's "
                f"{module} (expected {[len(ids), model.hidden_size]})"
            )
        values = tensors[found] if load_weights else None
        if values is not None and not torch.isfinite(values).all():
            raise AdapterError(f"tensor {found!r}: contains NaN or Inf values")
        out.append(TrainableTokens(module, ids, values))
    embed = next((t for t in out if t.module == "embed_tokens"), None)
    if embed is not None and model.tie_word_embeddings and "lm_head" not in names:
        out.append(TrainableTokens("lm_head", embed.indices, embed.values))
    return tuple(out)
