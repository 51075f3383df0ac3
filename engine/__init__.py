"""loraplex's inference engine.

from engine import LLM, SamplingParams, LoRARequest

`LLM` and `LLMEngine` are imported on first use, so a process that needs only parts of the engine (a
tensor-parallel worker, `engine/distributed/worker.py`) does not import the tokenizer and structured
output stacks.
"""

from typing import TYPE_CHECKING, Any

from engine.engine_config import EngineConfig
from engine.lora_request import LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    """`LLM` and `LLMEngine`, imported when first asked for."""
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
