"""Read and validate a PEFT LoRA adapter directory against a base model (`inspect_adapter`).

Shared by the registry (validation on registration) and the engine (loading). The only engine imports
allowed here are `engine.model_config` and `engine.model.registry` (the family's LoRA target names): the
registry imports this module without needing the engine's step machinery.

The parts, one file each:
- `engine/lora/adapter_dir.py`: the directory's two files, the config JSON and the content digest;
- `engine/lora/adapter_weights.py`: what a validated adapter is (`AdapterCheckpoint`, `LoRAModuleWeights`)
  and the shapes of the engine's slices;
- `engine/lora/tensor_names.py`: what a tensor's name says (module, layer, A/B/bias/magnitude);
- `engine/lora/projection_lora.py`: one module's LoRA validated from its tensors;
- `engine/lora/adapter_rules.py` (the config's rules), `vocab_checkpoint.py`, `expert_checkpoint.py`.
This module sorts the tensors of the file into those parts and puts the adapter together; the names
above are importable from here too.

Tensor names are those of the base model's family (`engine/model/family.py`, `lora_targets`): Llama's
`q_proj` … `down_proj`, or Phi-3's fused `qkv_proj` / `gate_up_proj`, whose lora_B rows are split into
the engine's slices (q|k|v, gate|up): `(x @ A.T) @ B_s.T` is the rows of slice s of the fused delta.

DoRA adapters (`use_dora`) carry a `lora_magnitude_vector` per module (one entry per output row) and
`lora_bias` adapters a `lora_B.bias`; both are split per slice like lora_B's rows and kept with the
slice's weights (`LoRAModuleWeights.magnitude`, `.bias_b`). The DoRA weight norm needs the base weight, so
it is computed by the engine's pool (`engine/lora/dora.py`), not here.

LoRA on `embed_tokens` / `lm_head` (`engine/lora/vocab_checkpoint.py`) is kept apart from the
projections' (`AdapterCheckpoint.vocab`): its shapes are at vocabulary width.
"""

from __future__ import annotations

from pathlib import Path

from engine.lora.adapter_dir import (
    CONFIG_FILE,
    PICKLE_FILES,
    adapter_digest,
    adapter_files,
    canonical_config_bytes,
    content_digest,
    load_adapter_config,
    parse_adapter_config,
)
from engine.lora.adapter_error import AdapterError
from engine.lora.adapter_rules import AdapterRules, check_config, target_set
from engine.lora.adapter_weights import (
    PROJECTIONS,
    AdapterCheckpoint,
    LoRAModuleWeights,
    module_features,
    target_features,
)
from engine.lora.expert_checkpoint import ExpertTensors
from engine.lora.projection_lora import TensorSource, projection_weights, vocab_weights
from engine.lora.safetensors_file import WEIGHTS_FILE, load_tensors, parse_safetensors_header
from engine.lora.tensor_names import engine_module, parse_tensor_name
from engine.lora.vocab_checkpoint import (
    saved_copies,
    saved_modules,
    token_tensor,
    trainable_tokens,
    vocab_tensor,
)
from engine.model.registry import model_family
from engine.model_config import ModelConfig

__all__ = [
    "CONFIG_FILE",
    "PICKLE_FILES",
    "PROJECTIONS",
    "WEIGHTS_FILE",
    "AdapterCheckpoint",
    "AdapterError",
    "LoRAModuleWeights",
    "adapter_digest",
    "adapter_files",
    "canonical_config_bytes",
    "inspect_adapter",
    "load_adapter_config",
    "module_features",
    "parse_adapter_config",
    "target_features",
]


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
    digest = content_digest(config, data)

    pairs: dict[tuple[int, str], dict[str, str]] = {}
    vocab_pairs: dict[str, dict[str, str]] = {}
    token_names: dict[str, str] = {}
    saved_names = saved_copies(config, header, family.checkpoint_key)
    saved_tensors = {name for name, _ in saved_names.values()}
    experts = ExpertTensors(config, model, rules)
    for name in header:
        if name in saved_tensors or experts.take(name):
            continue
        engine_key = engine_module(name, family.checkpoint_key)
        tok = token_tensor(name, engine_key)
        if tok is not None:
            if tok in token_names:
                raise AdapterError(f"tensor {name!r}: duplicate trainable tokens of {tok}")
            token_names[tok] = name
            continue
        vt = vocab_tensor(name, engine_key)
        if vt is not None:
            _add_vocab_tensor(name, vt, vocab_pairs, vocab_targeted, rules)
            continue
        parsed = parse_tensor_name(name, model, targets)
        if parsed is None:  # e.g. a vision tower's LoRA: text-only passes never run it
            continue
        _add_projection_tensor(name, parsed, pairs, targeted, rules)
    if (
        not pairs
        and not token_names
        and not saved_names
        and not experts
        and not any(set(v) - {"base"} for v in vocab_pairs.values())
    ):
        raise AdapterError(f"{WEIGHTS_FILE}: contains no LoRA tensors")

    tensors = load_tensors(data) if load_weights else {}
    src = TensorSource(header, tensors, rules, model, max_lora_rank, load_weights)
    vocab = tuple(
        vocab_weights(module, vocab_pairs[module], src)
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
        modules += projection_weights(layer, module, targets[module], slot, src)

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


def _add_projection_tensor(
    name: str,
    parsed: tuple[int, str, str],
    pairs: dict[tuple[int, str], dict[str, str]],
    targeted: set[tuple[int, str]] | None,
    rules: AdapterRules,
) -> None:
    """Record a projection's tensor (`parse_tensor_name`'s (layer, module, kind)), refusing one the
    config does not select or declare, and duplicates."""
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
