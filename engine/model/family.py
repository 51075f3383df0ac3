"""What one model family contributes to the engine: `ModelFamily`, one per file under `engine/model/`.

A family names its architectures (`config.json`'s `architectures`), builds its module tree, adjusts the
generic `config.json` parse (`configure`), maps its checkpoint's per-layer module names onto the engine's
packed projections (`checkpoint_modules`) and names the modules PEFT adapters of it target
(`lora_targets`), each feeding one or more of the engine's LoRA slices. `engine/model/registry.py`
maps each architecture to its family's module.

The engine's LoRA slices are the seven logical projections of `engine.lora.adapter_checkpoint.PROJECTIONS`
(q, k, v, o, gate, up, down), packed as q|k|v, o, gate|up, down; the adapter pool is laid out by them. A
fused PEFT target (Phi-3's `qkv_proj`) feeds several slices: its lora_B rows split across them, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.model.decoder import DecoderForCausalLM
    from engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """A module PEFT adapters name: `model.layers.N.{parent}.{name}`, feeding the engine's `slices`."""

    parent: str  # "self_attn" or "mlp"
    slices: tuple[str, ...]  # engine LoRA slices its output rows feed, in row order


# HF per-layer module -> (the engine's module, slice index in it; None: the whole weight)
LLAMA_CHECKPOINT_MODULES: Mapping[str, tuple[str, int | None]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}

# q, k, v, o, gate, up, down as their own PEFT targets (Llama, Mistral, Qwen, Granite, Gemma)
LLAMA_LORA_TARGETS: Mapping[str, LoRATarget] = {
    "q_proj": LoRATarget("self_attn", ("q_proj",)),
    "k_proj": LoRATarget("self_attn", ("k_proj",)),
    "v_proj": LoRATarget("self_attn", ("v_proj",)),
    "o_proj": LoRATarget("self_attn", ("o_proj",)),
    "gate_proj": LoRATarget("mlp", ("gate_proj",)),
    "up_proj": LoRATarget("mlp", ("up_proj",)),
    "down_proj": LoRATarget("mlp", ("down_proj",)),
}


def no_overrides(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The default `configure`: the generic parse as is."""
    return {}


def as_is(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The default `normalize`: config.json as it is."""
    return raw


def same_key(key: str) -> str | None:
    """The default `checkpoint_key`: the tensor name as it is."""
    return key


def no_aliases(arch: str, module: str) -> tuple[str, ...]:
    """The default `module_aliases`: the HF model names its modules as the engine does."""
    return ()


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One family's hooks (module docstring)."""

    architectures: tuple[str, ...]
    build: Callable[[ModelConfig], DecoderForCausalLM]  # the module tree, on the current default device
    # (architecture, raw config.json) -> `ModelConfig` fields to override; an "extra" dict is merged
    configure: Callable[[str, dict[str, Any]], dict[str, Any]] = no_overrides
    # (architecture, raw config.json) -> the config.json the generic parse reads (e.g. a multimodal
    # checkpoint's `text_config` lifted to the top, with its family's defaults filled in)
    normalize: Callable[[str, dict[str, Any]], dict[str, Any]] = as_is
    # a checkpoint tensor's name -> the Llama-style name (`model.layers.N...`) the loader maps, or None
    # to skip it (e.g. a multimodal checkpoint's `model.language_model.` prefix, its vision tower)
    checkpoint_key: Callable[[str], str | None] = same_key
    # (architecture, engine module name `model.layers.N.{parent}.{proj}`) -> the other names the
    # checkpoint's HF model gives it (PEFT's regex `target_modules` are matched against those too)
    module_aliases: Callable[[str, str], tuple[str, ...]] = no_aliases
    rope_types: tuple[str, ...] = ("llama3",)  # `rope_scaling` types it accepts besides "default"
    checkpoint_modules: Mapping[str, tuple[str, int | None]] = field(
        default_factory=lambda: LLAMA_CHECKPOINT_MODULES
    )
    lora_targets: Mapping[str, LoRATarget] = field(default_factory=lambda: LLAMA_LORA_TARGETS)
    # module names of the family's models an adapter may name but the engine does not adapt -> why
    # (a MoE model's router and experts); validation refuses them with that reason, naming the module
    lora_refused: Mapping[str, str] = field(default_factory=dict)
    # architectures whose llama.cpp GGUF files store q/k rows permuted (`engine/model/gguf_loader.py`)
    gguf_permuted: tuple[str, ...] = ()
    # GGUF per-layer tensor -> HF module, where the family's differ from Llama's (e.g. fused attn_qkv)
    gguf_layer_modules: Mapping[str, str] = field(default_factory=dict)
    # (metadata getter for `{gguf arch}.<key>`, float list of a tensor or None) -> config.json fields
    gguf_config: Callable[[GGUFMeta, GGUFVector], dict[str, Any]] | None = None
    # (HF key, float32 tensor from a GGUF file) -> the HF checkpoint's tensor, where llama.cpp's converter
    # changed values (Gemma: every RMSNorm weight written as 1 + w)
    gguf_tensor: Callable[[str, torch.Tensor], torch.Tensor] | None = None


GGUFMeta = Callable[[str, Any], Any]  # (key under `{arch}.`, default) -> the metadata value
GGUFVector = Callable[[str], "list[float] | None"]  # tensor name -> its values (None: not in the file)
