"""The safetensors framing of `adapter_model.safetensors`, checked before any tensor is read."""

from __future__ import annotations

import json
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from engine.lora.adapter_error import AdapterError

WEIGHTS_FILE = "adapter_model.safetensors"
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def parse_safetensors_header(data: bytes) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Validate the safetensors framing and return {tensor name: (dtype, shape)}.

    Layout: u64 little-endian header length N, N bytes of JSON, then the tensor data; every tensor's
    `data_offsets` must lie inside the data and the data must end exactly at the last tensor.
    """
    if len(data) < 8:
        raise AdapterError(f"{WEIGHTS_FILE}: truncated (only {len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > len(data):
        raise AdapterError(f"{WEIGHTS_FILE}: truncated or corrupt header (declares {n} header bytes)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE}: corrupt header ({exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE}: corrupt header (not a JSON object)")
    header.pop("__metadata__", None)
    body = len(data) - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        try:
            dtype, shape, (start, stop) = (
                info["dtype"],
                tuple(int(s) for s in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"tensor {name!r}: corrupt safetensors entry") from exc
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"tensor {name!r}: dtype {dtype} is not a floating-point type")
        if not 0 <= start <= stop <= body:
            raise AdapterError(f"tensor {name!r}: data lies outside the file ({WEIGHTS_FILE} truncated?)")
        end = max(end, stop)
        out[name] = (dtype, shape)
    if end != body:
        raise AdapterError(f"{WEIGHTS_FILE}: {body - end} unexpected bytes after the tensors (corrupt file)")
    return out


def load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes `data` (already checked by `parse_safetensors_header`)."""
    try:
        return load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE}: corrupt ({exc})") from exc
