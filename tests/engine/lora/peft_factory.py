"""Build real PEFT LoRA adapters on a tiny random Llama, for tests (nothing is downloaded)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def tiny_llama_config() -> LlamaConfig:
    """The config of the tiny test Llama (GQA: 4 query heads, 2 kv heads, head_dim 16)."""
    cfg = LlamaConfig(**TINY_LLAMA)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def write_base_model(directory: Path) -> Path:
    """Write the tiny Llama's `config.json` (all that adapter validation needs); return the dir."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_llama_config().save_pretrained(directory)
    return directory


def make_adapter(directory: Path, seed: int = 0, **lora_kwargs: Any) -> dict[str, torch.Tensor]:
    """Save a PEFT adapter with random A and B to `directory`; return the PEFT model's LoRA state dict.

    `lora_kwargs` go to `LoraConfig` (default: r=4, alpha=8 on q_proj and v_proj).
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    kwargs: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]} | lora_kwargs
    peft_model = get_peft_model(model, LoraConfig(**kwargs))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    peft_model.save_pretrained(directory)
    return {k: v.detach().clone() for k, v in peft_model.state_dict().items() if "lora_" in k}


def edit_config(directory: Path, **changes: Any) -> None:
    """Set (or with value `...`, delete) fields of `directory/adapter_config.json`."""
    path = directory / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg, indent=2))


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "adapter_model.safetensors")


def write_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors")


def mutate_tensors(directory: Path, fn: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    """Rewrite the adapter's safetensors file after `fn` changed its tensors (a dict, edited in place)."""
    tensors = read_tensors(directory)
    fn(tensors)
    write_tensors(directory, tensors)


def header_length(directory: Path) -> int:
    """Byte length of the safetensors header (the 8-byte prefix included)."""
    data = (directory / "adapter_model.safetensors").read_bytes()
    return 8 + struct.unpack("<Q", data[:8])[0]
