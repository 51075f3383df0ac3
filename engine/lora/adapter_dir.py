"""The files of a PEFT adapter directory, its config JSON and its content digest.

An adapter directory holds `adapter_config.json` + `adapter_model.safetensors`. Its identity is

    digest = sha256(canonical_config_json_bytes ‖ safetensors_bytes)

where the canonical JSON has sorted keys and no insignificant whitespace, so reformatting the JSON does
not change the digest while any change of a value or a weight byte does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.lora.adapter_error import AdapterError
from engine.lora.safetensors_file import WEIGHTS_FILE

CONFIG_FILE = "adapter_config.json"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")


def canonical_config_bytes(config: dict[str, Any]) -> bytes:
    """The adapter config as canonical JSON: sorted keys, no insignificant whitespace, UTF-8."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def content_digest(config: dict[str, Any], weights: bytes) -> str:
    """sha256 hex of the canonical config JSON followed by the safetensors bytes `weights`."""
    return hashlib.sha256(canonical_config_bytes(config) + weights).hexdigest()


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
