"""Validate a staged adapter against the base model, with the LoRA loader's own rules and messages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.lora.adapter_checkpoint import (
    CONFIG_FILE,
    AdapterCheckpoint,
    AdapterError,
    canonical_config_bytes,
    inspect_adapter,
    load_adapter_config,
)
from engine.model_config import ModelConfig, ModelConfigError
from lora_registry.errors import InvalidAdapter, RegistryError


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
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def validate_adapter(
    directory: Path, model: ModelConfig, max_lora_rank: int
) -> tuple[AdapterCheckpoint, bytes]:
    """(checkpoint facts, canonical config bytes) of the adapter in `directory`, or `InvalidAdapter`."""
    try:
        checkpoint = inspect_adapter(directory, model, max_lora_rank=max_lora_rank, load_weights=True)
        config = canonical_config_bytes(load_adapter_config(directory / CONFIG_FILE))
    except AdapterError as exc:
        raise InvalidAdapter(str(exc)) from exc
    return checkpoint, config
