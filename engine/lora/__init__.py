"""LoRA adapters in the engine: the PEFT checkpoint reader (and, later, the adapter pool)."""

from engine.lora.adapter_checkpoint import (
    AdapterCheckpoint,
    AdapterError,
    LoRAModuleWeights,
    adapter_digest,
    inspect_adapter,
)

__all__ = ["AdapterCheckpoint", "AdapterError", "LoRAModuleWeights", "adapter_digest", "inspect_adapter"]
