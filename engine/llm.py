"""`LLM`: offline batch generation on top of `LLMEngine` (the public Python API of the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a Hugging Face checkpoint directory once; `generate` many prompts in continuous batches."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        """`kwargs` are `EngineConfig` fields (their defaults apply), e.g. `dtype`, `device`, `max_loras`."""
        config = EngineConfig(model=str(model), **kwargs)
        self.engine = LLMEngine(config)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of `prompts`.

        `sampling_params` and `lora_request` are one for all prompts or one per prompt (None = base
        model). All prompts and adapters are validated before any request is queued, so a bad one leaves
        the engine untouched. Any number of distinct adapters may be mixed: the scheduler rotates them
        through the `max_loras` per-step slots and the adapter pool.
        """
        prompts = _as_batch(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority has {len(prios)} entries for {len(prompts)} prompts")
        for p in prompts:
            self.engine.tokenize(p)
        for lr in {lr for lr in loras if lr is not None}:
            self.engine.add_lora(lr)  # validates every adapter before anything is queued
        ids = []
        try:
            for prompt, sp, lr, pr in zip(prompts, params, loras, prios, strict=True):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, sp, lr, priority=pr)
                ids.append(rid)
            final: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [final[rid] for rid in ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A list of prompts (a single prompt, text or token ids, becomes a batch of one)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]
    return list(cast(Sequence[Prompt], prompts))


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
