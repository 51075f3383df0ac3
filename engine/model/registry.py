"""Which family module runs each architecture: one entry per architecture (`engine/model/family.py`).

The family modules are imported on first use, so this module (read by `engine.model_config` and the
adapter validation) imports no model code itself.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model.family import ModelFamily

# config.json architecture -> the module under engine/model/ whose FAMILY runs it
FAMILY_MODULES = {
    "LlamaForCausalLM": "engine.model.llama",
    "MistralForCausalLM": "engine.model.llama",
    "Qwen2ForCausalLM": "engine.model.llama",
    "Qwen3ForCausalLM": "engine.model.llama",
    "Gemma2ForCausalLM": "engine.model.gemma2",
    "Gemma3ForCausalLM": "engine.model.gemma3",
    "Gemma3ForConditionalGeneration": "engine.model.gemma3",
    "GraniteForCausalLM": "engine.model.granite",
    "Phi3ForCausalLM": "engine.model.phi3",
    "Qwen3MoeForCausalLM": "engine.model.qwen3_moe",
    "MixtralForCausalLM": "engine.model.mixtral",
    "Qwen2MoeForCausalLM": "engine.model.qwen2_moe",
    "OlmoeForCausalLM": "engine.model.olmoe",
}

SUPPORTED_ARCHITECTURES = tuple(FAMILY_MODULES)


@functools.cache
def model_family(architecture: str) -> ModelFamily:
    """The `ModelFamily` that runs `architecture`; KeyError for an architecture not in the registry."""
    family: ModelFamily = importlib.import_module(FAMILY_MODULES[architecture]).FAMILY
    if architecture not in family.architectures:
        raise KeyError(f"{FAMILY_MODULES[architecture]}.FAMILY does not list {architecture}")
    return family
