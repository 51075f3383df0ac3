"""What the name of a tensor in `adapter_model.safetensors` says: the module it adapts (in the engine's
names, through the family's `checkpoint_key`) and which part of that module's LoRA it is.

PEFT names a projection's tensors

    base_model.model.<module path>.lora_A[.<adapter name>].weight      A: [rank, in_features]
    base_model.model.<module path>.lora_B[.<adapter name>].weight      B: [out_features, rank]
    base_model.model.<module path>.lora_B[.<adapter name>].bias        lora_bias: [out_features]
    base_model.model.<module path>.lora_magnitude_vector[.<adapter name>][.weight]   DoRA: [out_features]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from engine.lora.adapter_error import AdapterError
from engine.lora.adapter_rules import EMBEDDING_NAMES, refused_part
from engine.model.family import LoRATarget
from engine.model.registry import model_family
from engine.model_config import ModelConfig

_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.(?P<kind>weight|bias)|lora_magnitude_vector(?:\.[^.]+)?)$"
)
_MODULE_RE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<proj>\w+)$")
_ADAPTED_MODULE_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?:lora_|base_layer\.|token_adapter\.)"
)


def engine_module(name: str, checkpoint_key: Callable[[str], str | None]) -> str | None:
    """The engine's name (without ".weight") of the module a LoRA tensor belongs to, or None."""
    m = _ADAPTED_MODULE_RE.match(name)
    if m is None:
        return None
    key = checkpoint_key(m["module"] + ".weight")
    return None if key is None else str(key).removesuffix(".weight")


def parse_tensor_name(
    name: str, model: ModelConfig, targets: Mapping[str, LoRATarget]
) -> tuple[int, str, str] | None:
    """(layer, target module, kind) of a projection's LoRA tensor, kind "A" | "B" (the weights), "b"
    (lora_B's bias) or "M" (DoRA's magnitude); None for a module outside the served text model
    (`checkpoint_key` of the family: Gemma 3's vision tower); `AdapterError` for anything else."""
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
