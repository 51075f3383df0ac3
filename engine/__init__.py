"""loraplex's single-device inference engine.

from engine import LLM, SamplingParams, LoRARequest
"""

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

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
