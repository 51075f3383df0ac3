"""The parts every generation route shares: resolve the model, tokenize, validate, run, map errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.auth import authenticate, authorize
from api.engine_client import EngineDeadError, EngineUnavailableError
from api.errors import APIError
from api.generation import ChoiceUpdate, Generation, SamplingSpec
from api.openai_protocol import _SamplingFields
from engine.lora_request import LoRARequest
from kernels.intmath import cdiv


@dataclass(slots=True)
class Target:
    """What a request runs on: the base model, or an active adapter (registry PEFT dir + digest)."""

    model_name: str
    lora: LoRARequest | None

    @property
    def adapter(self) -> str | None:
        return self.lora.name if self.lora else None


async def resolve_target(request: Request, model: str | None, forced_adapter: str | None = None) -> Target:
    """The base model or an active adapter named by the request: 401 without a valid API key (when keys
    are required), 404 for an unknown or inactive adapter, 403 when the key's scope excludes it."""
    state = request.app.state.loraplex
    key = await authenticate(request)
    name = forced_adapter or model or state.settings.served_model_name
    if forced_adapter is None and name == state.settings.served_model_name:
        authorize(key, None)
        return Target(name, None)
    target = await adapter_target(state, name)
    authorize(key, name)
    return target


async def adapter_target(state, name: str) -> Target:
    """The active adapter `name` with its PEFT directory; 404 when it is unknown or inactive."""
    active = state.follower.snapshot().get(name)
    if active is None:
        active = await run_in_threadpool(state.registry.adapters.active_adapter, name)
    if active is None:
        raise APIError(
            404, f"The model '{name}' does not exist or is not active", param="model", code="model_not_found"
        )
    path = await run_in_threadpool(state.registry.adapters.adapter_path, active.digest)
    return Target(name, LoRARequest(name, str(path), active.digest))


def tokenize(state, prompt: str | list[int]) -> list[int]:
    """Token ids of a prompt given as text or ids; 400 for text without a tokenizer or bad ids."""
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer; send the prompt as a list of token ids", param="prompt"
            )
        ids = state.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = state.client.info.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    return ids


def sampling_spec(
    state, body: _SamplingFields, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None
) -> SamplingSpec:
    """Validated engine settings for every prompt: 400 if a prompt or prompt + max_tokens cannot fit."""
    info = state.client.info
    longest = max(len(p) for p in prompts)
    if longest >= info.max_model_len:
        raise APIError(
            400,
            f"prompt has {longest} tokens; this model's context is {info.max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = info.max_model_len - longest
    total = min(longest + max_tokens, info.max_model_len)
    if cdiv(total, info.block_size) > info.num_kv_blocks:
        raise APIError(
            400,
            f"prompt + max_tokens ({total} tokens) exceed the KV cache "
            f"({info.num_kv_blocks * info.block_size} tokens)",
            param="max_tokens",
        )
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        priority=body.priority,
    )


class RequestRun:
    """Runs a `Generation`, records metrics and traffic, and turns engine failures into API errors."""

    def __init__(self, request: Request, target: Target, gen: Generation, num_prompt_tokens: int) -> None:
        self.request, self.target, self.gen = request, target, gen
        self.state = request.app.state.loraplex
        self.t0 = time.monotonic()
        self.first_token: float | None = None
        self.num_prompt_tokens = num_prompt_tokens

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        status = "error"
        try:
            async for up in self.gen.stream():
                if up.choice.error:
                    raise APIError(500, f"generation failed: {up.choice.error}")
                if self.first_token is None and up.choice.token_ids:
                    self.first_token = time.monotonic()
                yield up
            status = "ok"
        except EngineDeadError as exc:
            raise APIError(503, "the engine process died while serving this request; retry shortly") from exc
        except EngineUnavailableError as exc:
            raise APIError(503, "the engine is restarting; retry shortly") from exc
        except (asyncio.CancelledError, GeneratorExit):
            status = "aborted"
            raise
        finally:
            self._record(status)

    def _record(self, status: str) -> None:
        m, label = self.state.metrics, self.target.adapter or ""
        tokens = sum(len(c.token_ids) for c in self.gen.choices)
        m.requests.labels(label, status).inc()
        m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(label).inc(tokens)
        if self.first_token is not None:
            m.ttft.labels(label).observe(self.first_token - self.t0)
            if tokens > 1:
                m.tpot.labels(label).observe((time.monotonic() - self.first_token) / (tokens - 1))
        self.state.traffic.record(self.target.adapter, tokens)

    async def collect(self) -> None:
        """Run to completion, aborting the engine requests if the client disconnects meanwhile."""
        watcher = asyncio.create_task(self._watch_disconnect(asyncio.current_task()))
        try:
            async for _ in self.updates():
                pass
        finally:
            watcher.cancel()

    async def _watch_disconnect(self, task: asyncio.Task | None) -> None:
        while True:
            await asyncio.sleep(0.25)
            if await self.request.is_disconnected():
                if task is not None:
                    task.cancel()
                return


def usage(gen: Generation, num_prompt_tokens: int) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in gen.choices)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
    }


def finish_reason(reason: str | None) -> str | None:
    return "length" if reason == "length" else ("stop" if reason is not None else None)
