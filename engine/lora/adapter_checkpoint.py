"""Read and validate a PEFT LoRA adapter directory against a base model.

Shared by the registry (validation on registration) and the engine (loading). The only engine imports
allowed here are `engine.model_config` and `engine.model.registry` (the family's LoRA target names): the
registry imports this module without needing the engine's step machinery.

Tensor names are those of the base model's family (`engine/model/family.py`, `lora_targets`): Llama's
`q_proj` … `down_proj`, or Phi-3's fused `qkv_proj` / `gate_up_proj`, whose lora_B rows are split into
the engine's slices (q|k|v, gate|up) here: `(x @ A.T) @ B_s.T` is the rows of slice s of the fused delta.

DoRA adapters (`use_dora`) carry a `lora_magnitude_vector` per module (one entry per output row) and
`lora_bias` adapters a `lora_B.bias`; both are split per slice like lora_B's rows and kept with the
slice's weights (`LoRAModuleWeights.magnitude`, `.bias_b`). The DoRA weight norm needs the base weight, so
it is computed by the engine's pool (`engine/lora/dora.py`), not here.

LoRA on `embed_tokens` / `lm_head` (`engine/lora/vocab_checkpoint.py`) is kept apart from the
projections' (`AdapterCheckpoint.vocab`): its shapes are at vocabulary width.

An adapter directory holds `adapter_config.json` + `adapter_model.safetensors`. Its identity is

    digest = sha256(canonical_config_json_bytes ‖ safetensors_bytes)

where the canonical JSON has sorted keys and no insignificant whitespace, so reformatting the JSON does
not change the digest while any change of a value or a weight byte does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.lora.adapter_error import AdapterError as AdapterError
from engine.lora.adapter_rules import EMBEDDING_NAMES, AdapterRules, check_config, refused_part, target_set
from engine.lora.expert_checkpoint import ExpertLoRAWeights, ExpertTensors
from engine.lora.safetensors_file import WEIGHTS_FILE, load_tensors, parse_safetensors_header
from engine.lora.vocab_checkpoint import (
    SavedModule,
    TrainableTokens,
    VocabLoRAWeights,
    saved_copies,
    saved_modules,
    token_tensor,
    trainable_tokens,
    vocab_shape,
    vocab_tensor,
)
from engine.model.family import LoRATarget
from engine.model.registry import model_family
from engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")
# The engine's LoRA slices (the adapter pool's modules), whatever names the family's adapters use
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.<module path>.lora_A[.<adapter name>].weight, lora_B[...].bias (lora_bias) and
# lora_magnitude_vector[.<adapter name>][.weight] (DoRA)
_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.(?P<kind>weight|bias)|lora_magnitude_vector(?:\.[^.]+)?)$"
)
_MODULE_RE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)$")


@dataclass(slots=True, frozen=True)
class LoRAModuleWeights:
    """One adapted engine slice (`PROJECTIONS`): `delta_y = scaling * (x @ lora_a.T) @ lora_b.T`."""

    layer: int
    module: str
    rank: int
    alpha: float
    scaling: float
    lora_a: torch.Tensor | None  # [rank, in_features]; None when inspected without weights
    lora_b: torch.Tensor | None  # [out_features, rank]
    magnitude: torch.Tensor | None = None  # DoRA: [out_features] (None: plain LoRA, or no weights loaded)
    bias_b: torch.Tensor | None = None  # lora_bias: lora_B's bias [out_features] (added times scaling)


@dataclass(slots=True, frozen=True)
class AdapterCheckpoint:
    """A validated adapter: its identity, summary facts and (optionally) its weights."""

    digest: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # the family's module names the adapter has weights for
    use_rslora: bool
    size_bytes: int
    base_model_name: str | None
    modules: tuple[LoRAModuleWeights, ...]
    use_dora: bool = False
    lora_bias: bool = False
    vocab: tuple[VocabLoRAWeights, ...] = ()  # LoRA on embed_tokens / lm_head
    tokens: tuple[TrainableTokens, ...] = ()  # trainable_token_indices: replaced rows of embed / head
    saved: tuple[SavedModule, ...] = ()  # modules_to_save: whole copies of embed_tokens / lm_head
    experts: tuple[ExpertLoRAWeights, ...] = ()  # LoRA on a MoE model's routed experts
    # what the engine derives from these weights and the base model (DoRA's epilogue vectors), kept with
    # the host copy so it is computed once per load; not part of the adapter's identity
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def module_features(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of the engine's LoRA slice `module` (`PROJECTIONS`) in `model`."""
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def target_features(model: ModelConfig, target: LoRATarget) -> tuple[int, int]:
    """(in_features, out_features) of a family's LoRA target: its slices' input, their summed outputs."""
    return module_features(model, target.slices[0])[0], sum(
        module_features(model, s)[1] for s in target.slices
    )


def canonical_config_bytes(config: dict[str, Any]) -> bytes:
    """The adapter config as canonical JSON: sorted keys, no insignificant whitespace, UTF-8."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(config file, weights file) of an adapter directory (or of one of its two files).

    Refuses a directory that has pickle weights but no safetensors file, and missing files.
    """
    root = Path(path)
    if root.is_file() and root.name in (CONFIG_FILE, WEIGHTS_FILE):
        root = root.parent
    if not root.is_dir():
        raise AdapterError(f"adapter path {str(root)!r}: not a directory")
    cfg, weights = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not cfg.is_file():
        raise AdapterError(f"{CONFIG_FILE}: missing in {root}")
    if not weights.is_file():
        pickled = [name for name in PICKLE_FILES if (root / name).exists()]
        if pickled:
            raise AdapterError(
                f"{pickled[0]}: pickle weights are refused (unsafe to load); save as {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{WEIGHTS_FILE}: missing in {root}")
    return cfg, weights


def load_adapter_config(cfg_file: Path) -> dict[str, Any]:
    """Parse `adapter_config.json` into a dict, or raise `AdapterError`."""
    return parse_adapter_config(cfg_file.read_bytes())


def parse_adapter_config(raw_bytes: bytes) -> dict[str, Any]:
    """Parse the bytes of `adapter_config.json` into a dict, or raise `AdapterError`."""
    try:
        raw = json.loads(raw_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE}: expected a JSON object, got {type(raw).__name__}")
    return raw


def adapter_digest(path: str | Path) -> str:
    """sha256 hex of canonical config JSON followed by the safetensors bytes (streamed)."""
    cfg_file, weights_file = adapter_files(path)
    h = hashlib.sha256(canonical_config_bytes(load_adapter_config(cfg_file)))
    with weights_file.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def inspect_adapter(
    path: str | Path,
    model: ModelConfig,
    max_lora_rank: int = 64,
    load_weights: bool = True,
    contents: tuple[bytes, bytes] | None = None,
) -> AdapterCheckpoint:
    """Validate the adapter at `path` against `model` and return its facts (and weights).

    `contents`: the (config, weights) bytes when the caller has read them already (then the files at
    `path` are not read). Every refusal raises `AdapterError` naming the field or tensor. NaN/Inf checks
    need the weights, so they run only with `load_weights=True`.
    """
    if contents is None:
        cfg_file, weights_file = adapter_files(path)
        contents = cfg_file.read_bytes(), weights_file.read_bytes()
    raw_config, data = contents
    config = parse_adapter_config(raw_config)
    rules = check_config(config)
    family = model_family(model.architecture)
    targets = family.lora_targets
    targeted, vocab_targeted = target_set(config, model, targets)
    header = parse_safetensors_header(data)
    digest = hashlib.sha256(canonical_config_bytes(config) + data).hexdigest()

    pairs: dict[tuple[int, str], dict[str, str]] = {}
    vocab_pairs: dict[str, dict[str, str]] = {}
    token_names: dict[str, str] = {}
    saved_names = saved_copies(config, header, family.checkpoint_key)
    saved_tensors = {name for name, _ in saved_names.values()}
    experts = ExpertTensors(config, model, rules)
    for name in header:
        if name in saved_tensors or experts.take(name):
            continue
        engine_module = _engine_module(name, family.checkpoint_key)
        tok = token_tensor(name, engine_module)
        if tok is not None:
            if tok in token_names:
                raise AdapterError(f"tensor {name!r}: duplicate trainable tokens of {tok}")
            token_names[tok] = name
            continue
        vt = vocab_tensor(name, engine_module)
        if vt is not None:
            _add_vocab_tensor(name, vt, vocab_pairs, vocab_targeted, rules)
            continue
        parsed = _parse_tensor_name(name, model, targets)
        if parsed is None:  # e.g. a vision tower's LoRA: text-only passes never run it
            continue
        layer, module, ab = parsed
        if ab == "M" and not rules.use_dora:
            raise AdapterError(f"tensor {name!r}: a DoRA magnitude vector, but use_dora is not set")
        if ab == "b" and not rules.lora_bias:
            raise AdapterError(f"tensor {name!r}: a lora_B bias, but lora_bias is not set")
        if targeted is not None and (layer, module) not in targeted:
            raise AdapterError(
                f"tensor {name!r}: module not selected by target_modules/layers_to_transform/exclude_modules"
            )
        slot = pairs.setdefault((layer, module), {})
        if ab in slot:
            raise AdapterError(f"tensor {name!r}: duplicate lora_{ab} for layer {layer} {module}")
        slot[ab] = name
    if (
        not pairs
        and not token_names
        and not saved_names
        and not experts
        and not any(set(v) - {"base"} for v in vocab_pairs.values())
    ):
        raise AdapterError(f"{WEIGHTS_FILE}: contains no LoRA tensors")

    tensors = load_tensors(data) if load_weights else {}
    vocab = tuple(
        _vocab_weights(
            module, vocab_pairs[module], header, tensors, rules, model, max_lora_rank, load_weights
        )
        for module in ("embed_tokens", "lm_head")
        if module in vocab_pairs and set(vocab_pairs[module]) - {"base"}
    )
    tokens = trainable_tokens(config, token_names, header, tensors, model, load_weights)
    if tokens and vocab:
        raise AdapterError(
            "trainable_token_indices: not supported together with LoRA on embed_tokens/lm_head "
            f"({', '.join(v.module for v in vocab)})"
        )
    saved = saved_modules(saved_names, header, tensors, model, load_weights)
    clash = {s.module for s in saved} & ({v.module for v in vocab} | {t.module for t in tokens})
    if clash:
        raise AdapterError(
            f"modules_to_save: {', '.join(sorted(clash))} also has a LoRA or trainable tokens "
            "(PEFT trains one or the other)"
        )
    modules: list[LoRAModuleWeights] = []
    order = list(targets)
    for (layer, module), slot in sorted(pairs.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        for ab in "AB" + ("M" if rules.use_dora else "") + ("b" if rules.lora_bias else ""):
            if ab not in slot:
                other = next(iter(slot.values()))
                what = {"M": "use_dora: DoRA's lora_magnitude_vector", "b": "lora_bias: its lora_B bias"}
                raise AdapterError(f"tensor {other!r}: {what.get(ab, f'its lora_{ab}')} partner is missing")
        target = targets[module]
        key = f"model.layers.{layer}.{target.parent}.{module}"
        rank, r_field = rules.rank_for(key)
        alpha = rules.alpha_for(key)
        if rank > max_lora_rank:
            raise AdapterError(
                f"{r_field}: rank {rank} of layer {layer} {module} exceeds max_lora_rank {max_lora_rank}"
            )
        in_f, out_f = target_features(model, target)
        _check_shape(slot["A"], header[slot["A"]], (rank, in_f), module)
        _check_shape(slot["B"], header[slot["B"]], (out_f, rank), module)
        for vec in "Mb":
            if vec in slot:
                _check_shape(slot[vec], header[slot[vec]], (out_f,), module)
        a = b = mag = bias_b = None
        if load_weights:
            a, b = tensors[slot["A"]], tensors[slot["B"]]
            mag, bias_b = tensors.get(slot.get("M", "")), tensors.get(slot.get("b", ""))
            for name in slot.values():
                if not torch.isfinite(tensors[name]).all():
                    raise AdapterError(f"tensor {name!r}: contains NaN or Inf values")
        scaling = alpha / math.sqrt(rank) if rules.use_rslora else alpha / rank
        row = 0
        for piece in target.slices:  # a fused target's B rows: one block per engine slice, in order
            width = module_features(model, piece)[1]
            rows = slice(row, row + width)
            b_rows = None if b is None else b[rows]
            m_rows = None if mag is None else mag[rows]
            bias_rows = None if bias_b is None else bias_b[rows]
            modules.append(
                LoRAModuleWeights(layer, piece, rank, alpha, scaling, a, b_rows, m_rows, bias_rows)
            )
            row += width

    expert_weights = experts.weights(header, tensors, max_lora_rank, load_weights)
    present = {module for _, module in pairs}
    expert_names = tuple(
        f"experts.{p}" for p in ("gate_up", "down") if any(w.proj == p for w in expert_weights)
    )
    return AdapterCheckpoint(
        digest=digest,
        rank=max([m.rank for m in modules] + [v.rank for v in vocab] + [w.rank for w in expert_weights]),
        alpha=rules.alpha,
        target_modules=tuple(p for p in targets if p in present)
        + tuple(v.module for v in vocab)
        + expert_names,
        use_rslora=rules.use_rslora,
        size_bytes=len(raw_config) + len(data),
        base_model_name=config.get("base_model_name_or_path"),
        modules=tuple(modules),
        use_dora=rules.use_dora,
        lora_bias=rules.lora_bias,
        vocab=vocab,
        tokens=tokens,
        saved=saved,
        experts=expert_weights,
    )


def _engine_module(name: str, checkpoint_key: Any) -> str | None:
    """The engine's name (without ".weight") of the module a LoRA tensor belongs to, or None."""
    m = re.match(r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?:lora_|base_layer\.|token_adapter\.)", name)
    if m is None:
        return None
    key = checkpoint_key(m["module"] + ".weight")
    return None if key is None else str(key).removesuffix(".weight")


def _add_vocab_tensor(
    name: str,
    vt: tuple[str, str],
    pairs: dict[str, dict[str, str]],
    targeted: set[str] | None,
    rules: AdapterRules,
) -> None:
    """Record an embed_tokens / lm_head tensor, refusing what the engine does not compute with it."""
    module, kind = vt
    if kind != "base":
        if targeted is not None and module not in targeted:
            raise AdapterError(f"tensor {name!r}: module not selected by target_modules/exclude_modules")
        if rules.use_dora:
            raise AdapterError(f"use_dora: DoRA on {module} is not supported (tensor {name!r})")
        if rules.lora_bias:
            raise AdapterError(f"lora_bias: a bias on {module}'s LoRA is not supported (tensor {name!r})")
    slot = pairs.setdefault(module, {})
    if kind in slot:
        raise AdapterError(f"tensor {name!r}: duplicate {kind} tensor of {module}")
    slot[kind] = name


def _vocab_weights(
    module: str,
    slot: dict[str, str],
    header: dict[str, tuple[str, tuple[int, ...]]],
    tensors: dict[str, torch.Tensor],
    rules: AdapterRules,
    model: ModelConfig,
    max_lora_rank: int,
    load_weights: bool,
) -> VocabLoRAWeights:
    """The validated LoRA of `module` (embed_tokens / lm_head) from its tensors `slot` (kind -> name)."""
    for ab in "AB":
        if ab not in slot:
            raise AdapterError(
                f"tensor {next(iter(slot.values()))!r}: its {module} lora_{ab} partner is missing"
            )
    key = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
    rank, r_field = rules.rank_for(key)
    if rank > max_lora_rank:
        raise AdapterError(f"{r_field}: rank {rank} of {module} exceeds max_lora_rank {max_lora_rank}")
    for kind, name in slot.items():
        _check_shape(name, header[name], vocab_shape(model, module, kind, rank), module)
    a = b = None
    if load_weights:
        a, b = tensors[slot["A"]], tensors[slot["B"]]
        for name in (slot["A"], slot["B"]):
            if not torch.isfinite(tensors[name]).all():
                raise AdapterError(f"tensor {name!r}: contains NaN or Inf values")
    alpha = rules.alpha_for(key)
    scaling = alpha / math.sqrt(rank) if rules.use_rslora else alpha / rank
    return VocabLoRAWeights(module, rank, alpha, scaling, a, b)


def _parse_tensor_name(
    name: str, model: ModelConfig, targets: Mapping[str, LoRATarget]
) -> tuple[int, str, str] | None:
    """(layer, target module, "A"|"B") of a LoRA tensor name; None for a module outside the served text
    model (`checkpoint_key` of the family: Gemma 3's vision tower); `AdapterError` for anything else."""
    if "lora_embedding_" in name or any(f"{e}." in name for e in EMBEDDING_NAMES):
        raise AdapterError(f"tensor {name!r}: embedding/lm_head adapters are not supported")
    m = _TENSOR_RE.match(name)
    if m is None:
        raise AdapterError(f"tensor {name!r}: not a LoRA A/B weight (unexpected tensor)")
    key = model_family(model.architecture).checkpoint_key(m["module"] + ".weight")  # the engine's name
    if key is None:
        return None
    refused = refused_part(model, key.removesuffix(".weight"))
    if refused is not None:
        raise AdapterError(f"tensor {name!r}: module {m['module']!r} {refused}")
    mm = _MODULE_RE.match(key.removesuffix(".weight"))
    if mm is None or mm["proj"] not in targets or targets[mm["proj"]].parent != mm["parent"]:
        raise AdapterError(f"tensor {name!r}: unknown module {m['module']!r}")
    layer = int(mm["layer"])
    if layer >= model.num_layers:
        raise AdapterError(
            f"tensor {name!r}: layer {layer} out of range (model has {model.num_layers} layers)"
        )
    kind = "M" if m["ab"] is None else ("b" if m["kind"] == "bias" else m["ab"])
    if kind == "b" and m["ab"] != "B":
        raise AdapterError(f"tensor {name!r}: a bias on lora_A (only lora_B has one, with lora_bias)")
    return layer, mm["proj"], kind


def _check_shape(name: str, entry: tuple[str, tuple[int, ...]], want: tuple[int, ...], module: str) -> None:
    shape = entry[1]
    if shape != want:
        raise AdapterError(
            f"tensor {name!r}: shape {list(shape)} does not fit the base model's {module} "
            f"(expected {list(want)})"
        )
