"""The engine's handle on a LoRA adapter: a name for humans and a path to its PEFT files."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """Ask the engine to apply the PEFT adapter stored at `path` (a directory with `adapter_config.json`
    and `adapter_model.safetensors`). The engine identifies adapters by content digest, not by `name`.

    `digest`, when the caller already knows it (a registry stores adapters content-addressed), spares the
    engine hashing the files; it is still verified when the weights are loaded.
    """

    name: str
    path: str
    digest: str | None = None
