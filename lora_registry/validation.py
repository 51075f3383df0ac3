"""Validate a staged adapter against the base model, with the LoRA loader's own rules and messages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.lora.adapter_checkpoint import (
    CONFIG_FILE,
    PROJECTIONS,
    WEIGHTS_FILE,
    AdapterCheckpoint,
    AdapterError,
    canonical_config_bytes,
    inspect_adapter,
    load_adapter_config,
    module_features,
)
from engine.lora.expert_targets import sparse_layers
from engine.lora.side_memory import check_side_budget
from engine.model_config import ModelConfig, ModelConfigError
from lora_registry.config_limits import check_config_file
from lora_registry.errors import InvalidAdapter, RegistryError

HEADER_SLACK_BYTES = 1024**2  # the safetensors header (tensor names, shapes) beside the weights


def load_base_model(path: Path) -> ModelConfig:
    """The base model's config, or a `RegistryError` saying why it cannot be read."""
    try:
        return ModelConfig.from_dir(path)
    except ModelConfigError as exc:
        raise RegistryError(f"base model {path}: {exc}") from exc


def model_fingerprint(model: ModelConfig) -> str:
    """sha256 of the architecture facts that decide whether an adapter fits (not of the weights)."""
    facts = {
        "architecture": model.architecture,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
    }
    moe = model.extra.get("moe")
    if moe:  # expert adapters are shaped by the experts (other models' fingerprints are unchanged)
        facts["moe"] = {k: moe[k] for k in ("num_experts", "intermediate_size")} | {
            "sparse_layers": sparse_layers(model)
        }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def validate_adapter(
    directory: Path, model: ModelConfig, max_lora_rank: int, side_budget: tuple[int, int] | None = None
) -> tuple[AdapterCheckpoint, bytes]:
    """(checkpoint facts, canonical config bytes) of the adapter in `directory`, or `InvalidAdapter`.
    `side_budget`: (bytes, bytes per element) the serving engine's pool has for side stores
    (`engine/lora/side_memory.py`): an adapter whose side stores exceed it is refused, with the numbers.

    The config's fields are bounded first (`config_limits`) and the weights file's size against the
    largest adapter the model admits, before the adapter reader loads either."""
    check_config_file(directory / CONFIG_FILE)
    weights = (directory / WEIGHTS_FILE).stat().st_size
    limit = max_adapter_bytes(model, max_lora_rank)
    if weights > limit:
        raise InvalidAdapter(
            f"{WEIGHTS_FILE}: {weights} bytes; an adapter of rank <= {max_lora_rank} for this model "
            f"has at most {limit} bytes"
        )
    try:
        checkpoint = inspect_adapter(directory, model, max_lora_rank=max_lora_rank, load_weights=True)
        config = canonical_config_bytes(load_adapter_config(directory / CONFIG_FILE))
        if side_budget is not None:
            check_side_budget(checkpoint, model, side_budget[1], side_budget[0])
    except AdapterError as exc:
        raise InvalidAdapter(str(exc)) from exc
    return checkpoint, config


def max_adapter_bytes(model: ModelConfig, max_lora_rank: int) -> int:
    """The largest valid adapter file for `model`: every projection of every layer at `max_lora_rank`,
    in float64 (8 bytes), plus the header: sum over layers and projections of r·(in + out)·8 + slack, plus
    a MoE model's expert LoRA (`max_expert_bytes`)."""
    per_layer = sum(max_lora_rank * sum(module_features(model, p)) * 8 for p in PROJECTIONS)
    return model.num_layers * per_layer + max_expert_bytes(model, max_lora_rank) + HEADER_SLACK_BYTES


def max_expert_bytes(model: ModelConfig, max_lora_rank: int) -> int:
    """The largest LoRA on a MoE model's routed experts, in float64: per sparse layer and expert, the
    per-expert layout's gate, up and down LoRAs (the larger layout): 3·r·(hidden + expert inter)·8."""
    layers = sparse_layers(model)
    if not layers:
        return 0
    moe = model.extra["moe"]
    per_expert = 3 * max_lora_rank * (model.hidden_size + int(moe["intermediate_size"])) * 8
    return len(layers) * int(moe["num_experts"]) * per_expert
