"""The parts every generation route shares: resolve the model, bound and tokenize prompts, map the body
to `SamplingParams`, run under the client's fair share, and map engine failures to API errors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.admission import ARRIVED, client_id
from api.auth import authenticate, authorize, may_use
from api.engine_client import (
    EngineDeadError,
    EngineStalledError,
    EngineUnavailableError,
    ServerShuttingDownError,
)
from api.errors import APIError
from api.generation import ChoiceUpdate, Generation
from api.limits.limiter import Grant
from api.mix import metric_label, mix_digest, mix_request
from api.openai_protocol import AdapterWeight, SamplingFields
from api.usage.service import usage_entry
from engine.lora_request import LoRARequest
from engine.request_tokens import resolve_request_tokens
from engine.sampling_params import SamplingParams, SamplingParamsError
from kernels.intmath import cdiv
from lora_registry.errors import RegistryUnavailable
from lora_registry.usage import UsageEntry

log = logging.getLogger("loraplex.requests")


@dataclass(slots=True)
class Target:
    """What a request runs on: the base model, or an active adapter (registry PEFT dir + digest), and
    the caller's API key (None when keys are not required, "admin" for the admin token)."""

    model_name: str
    lora: LoRARequest | None
    key: Any = None

    @property
    def adapter(self) -> str | None:
        """The adapter's name (a weighted mix: `a*0.7+b*0.3`); None for the base model."""
        return self.lora.name if self.lora else None

    @property
    def adapters(self) -> tuple[str, ...]:
        """Every adapter the request applies (a mix's members): the subjects of adapter rate limits."""
        return tuple(lr.name for lr, _ in self.lora.members()) if self.lora else ()

    @property
    def label(self) -> str:
        """The adapter as metrics label it ("" for the base model; a mix's members without weights)."""
        if self.lora is None:
            return ""
        return metric_label(self.lora) if self.lora.mix else self.lora.name

    @property
    def digest(self) -> str | None:
        """The adapter's content digest (a mix: the engine's key of its members and weights)."""
        if self.lora is None:
            return None
        return mix_digest(self.lora) if self.lora.mix else self.lora.digest


def is_base_model(state, name: str) -> bool:
    """Whether `name` is the base model: its served name or the checkpoint's own name."""
    return name == state.settings.served_model_name or name in state.settings.model_aliases


async def resolve_target(
    request: Request,
    model: str | None,
    forced_adapter: str | None = None,
    mix: list[AdapterWeight] | None = None,
) -> Target:
    """The base model or an active adapter named by the request: 401 without a valid API key (when keys
    are required), 403 when the key may not use the base model, 404 for an adapter that is unknown,
    inactive or outside the key's scope (the same answer for all three, so a scoped key cannot probe which
    adapter names exist; the scope is checked first, so neither does the time to answer tell).

    With `mix` (the body's `adapters`), the weighted mix of those adapters (`api/mix.py`)."""
    state = request.app.state.loraplex
    key = await authenticate(request)
    name = forced_adapter or model or state.settings.served_model_name
    if mix is not None:
        named = None if forced_adapter is None and is_base_model(state, name) else name
        shown = name if named is not None else state.settings.served_model_name
        return Target(shown, await mix_request(state, key, mix, named, adapter_target), key)
    if forced_adapter is None and is_base_model(state, name):
        authorize(key, None)
        return Target(state.settings.served_model_name, None, key)
    if not may_use(key, name):
        raise model_not_found(name, key)
    target = await adapter_target(state, name, key)
    target.key = key
    return target


def model_not_found(name: str, key: Any = None) -> APIError:
    """The 404 for an adapter `name` that does not exist, is not active, or (for a key scoped to named
    adapters) is not in the key's scope: one body for all of them."""
    scoped = key is not None and key != "admin" and not key.is_admin
    why = "does not exist or is not active"
    if scoped:
        why = "does not exist, is not active, or this API key may not use it"
    return APIError(404, f"The model '{name}' {why}", param="model", code="model_not_found")


async def adapter_target(state, name: str, key: Any = None) -> Target:
    """The active adapter `name` with its PEFT directory; 404 when it is unknown or inactive.

    Hot path: an adapter in the in-memory active set (kept current by the registry's events) whose
    directory is already materialized costs no database call and no worker thread. Only a name the
    set does not hold is looked up in the database (it may have been activated a moment ago), on the
    registry lookup lane; an unreachable registry then answers 503.
    """
    registry = state.registry.adapters
    try:
        active = state.follower.get(name)
        if active is None:
            active = await state.lookups.run(registry.active_adapter, name)
        if active is None:
            raise model_not_found(name, key)
        path = registry.materialized_path(active.digest)
        if path is None:
            path = await state.lookups.run(registry.adapter_path, active.digest)
    except RegistryUnavailable as exc:
        raise registry_unavailable(name) from exc
    return Target(name, LoRARequest(name, str(path), active.digest))


def registry_unavailable(name: str) -> APIError:
    """503 for a request whose adapter cannot be looked up while the registry database is unreachable."""
    return APIError(
        503,
        f"the adapter registry is unreachable, so the model '{name}' cannot be looked up; retry shortly",
        param="model",
        code="registry_unavailable",
        headers={"Retry-After": "2"},
    )


def check_choices(state, num_prompts: int, n: int) -> None:
    """400 when prompts × n exceeds what one request may fan out to."""
    limit = state.settings.max_choices_per_request
    if num_prompts * n > limit:
        raise APIError(
            400,
            f"{num_prompts} prompts × n={n} = {num_prompts * n} choices; at most {limit} per request",
            param="n",
        )


def check_prompt_chars(state, texts: list[str], param: str = "prompt") -> None:
    """400 `context_length_exceeded` when a prompt text is too long to be worth tokenizing."""
    info = state.client.info
    limit = state.settings.prompt_char_limit(info.max_model_len)
    longest = max((len(t) for t in texts), default=0)
    if longest > limit:
        raise APIError(
            400,
            f"prompt has {longest} characters; at most {limit} are accepted "
            f"(this model's context is {info.max_model_len} tokens)",
            param=param,
            code="context_length_exceeded",
        )


async def tokenize_prompts(state, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of every prompt (text or ids): text is length-checked first and tokenized off the event
    loop; 400 for text without a tokenizer, ids out of the vocabulary, empty or over-long prompts."""
    info = state.client.info
    texts = [p for p in prompts if isinstance(p, str)]
    check_prompt_chars(state, texts)
    if texts and state.tokenizer is None:
        raise APIError(
            400, "this model has no tokenizer; send the prompt as a list of token ids", param="prompt"
        )
    for p in prompts:
        if not isinstance(p, str):
            check_context(state, len(p))
            if any(t >= info.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {info.vocab_size})", param="prompt")
    encoded: list[list[int]] = []
    if texts:
        encoded = await run_in_threadpool(lambda: [list(state.tokenizer.encode(t)) for t in texts])
    it = iter(encoded)
    ids: list[list[int]] = [next(it) if isinstance(p, str) else list(p) for p in prompts]
    for p in ids:
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        check_context(state, len(p))
    return ids


def check_context(state, num_tokens: int) -> None:
    info = state.client.info
    if num_tokens >= info.max_model_len:
        raise APIError(
            400,
            f"prompt has {num_tokens} tokens; this model's context is {info.max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )


def sampling_params(
    state, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The engine's `SamplingParams` for each choice: 400 if a prompt or prompt + max_tokens cannot fit."""
    info = state.client.info
    longest = max(len(p) for p in prompts)
    check_context(state, longest)
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
    try:
        params = body.to_sampling_params(max_tokens, logprobs)
        # bad_words tokenized here (small: bounded words) so a bad one is a 400 naming it; token ids
        # checked against the vocabulary. The engine checks the result again.
        params = resolve_request_tokens(params, state.tokenizer, info.vocab_size)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc
    if body.stream and params.best_of is not None and params.best_of > params.n:
        raise APIError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")
    return params


class RequestRun:
    """Runs a `Generation`, records metrics and traffic, and turns engine failures into API errors."""

    def __init__(self, request: Request, target: Target, gen: Generation, num_prompt_tokens: int) -> None:
        self.request, self.target, self.gen = request, target, gen
        self.state = request.app.state.loraplex
        self.t0 = time.monotonic()
        self.first_token: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.client_gone = False  # set when the client disconnected before a non-streamed answer
        self.grant: Grant | None = None
        self.finished = False
        self._last_token: dict[int, float] = {}  # choice index -> when its latest tokens came

    async def admit(self) -> None:
        """Charge the caller's limits now, before costly preparation (compiling schemas): a 429 (or a
        503 from the limiter) is recorded and raised. Without this, `updates` admits the request."""
        if self.grant is not None:
            return
        try:
            self.grant = await self._admit()
        except APIError as exc:
            self._finish("rate_limited" if exc.status == 429 else "error")
            raise

    async def prepare(self, work: Awaitable[None]) -> None:
        """Await `work` (e.g. compiling the schemas) as part of this request: its time counts in the
        request's latency, and if it fails the request is recorded as an error and its grant released."""
        try:
            await work
        except BaseException as exc:
            self._finish("aborted" if isinstance(exc, asyncio.CancelledError) else "error")
            raise

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        status = "error"
        client = client_id(self.target.key, self.request)
        try:
            if self.grant is None:
                self.grant = await self._admit()
            arrived = getattr(self.request.state, ARRIVED, None)
            async with self.state.admission.hold(client, len(self.gen.choices), arrived):
                async for up in self.gen.stream():
                    if up.choice.error:
                        raise _choice_error(self.target, up.choice.error_status, up.choice.error)
                    if up.token_ids:
                        self._note_tokens(up.choice.index)
                    yield up
            status = "ok"
        except EngineStalledError as exc:
            raise APIError(503, f"{exc}; retry shortly") from exc
        except EngineDeadError as exc:
            raise APIError(503, "the engine process died while serving this request; retry shortly") from exc
        except EngineUnavailableError as exc:
            raise APIError(503, "the engine is restarting; retry shortly") from exc
        except APIError as exc:
            if exc.status == 429:  # refused by a rate limit or the client's fair share: it never ran
                status = "rate_limited"
            raise
        except ServerShuttingDownError as exc:
            raise APIError(
                503,
                "the server is shutting down and did not finish this request in time; retry it",
                code="server_shutting_down",
                headers={"Retry-After": "1"},
            ) from exc
        except (asyncio.CancelledError, GeneratorExit):
            status = "aborted"
            raise
        finally:
            self._finish(status)

    def _note_tokens(self, choice: int) -> None:
        """Time choice `choice`'s new tokens: the request's first token, and the gap since the choice's
        previous update (vLLM's inter-token latency)."""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        last = self._last_token.get(choice)
        if last is not None:
            self.state.metrics.vllm.inter_token(now - last)
        self._last_token[choice] = now

    def _finish(self, status: str) -> None:
        """Release the grant (refunding unused tokens) and record the request, once."""
        if self.finished:
            return
        self.finished = True
        if self.grant is not None:
            self.grant.release(self.num_prompt_tokens + sum(len(c.token_ids) for c in self.gen.choices))
        self._record(status)

    async def _admit(self) -> Grant:
        """Admit this request under its key's and adapter's limits, charging its most tokens: the
        prompts plus `max_tokens` per choice (the unused part is refunded when it finishes). 429 over a
        limit; the grant's `x-ratelimit-*` headers go on the answer."""
        usage = self.state.usage
        if usage is None:
            return Grant()
        most = self.num_prompt_tokens + len(self.gen.choices) * self.gen.params.max_tokens
        grant = await usage.admit(self.target.key, self.target.adapters, most)
        if grant.headers:
            self.request.state.ratelimit_headers = grant.headers
        return grant

    def _record(self, status: str) -> None:
        m, label = self.state.metrics, self.target.label
        tokens = sum(len(c.token_ids) for c in self.gen.choices)
        m.requests.labels(label, status).inc()
        if self.state.usage is not None:
            self.state.usage.record(self._usage_entry(status, tokens))
        if status == "rate_limited":
            return
        m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(label).inc(tokens)
        ttft = None if self.first_token is None else self.first_token - self.t0
        reasons = (c.finish_reason for c in self.gen.choices)
        m.vllm.record(reasons, self.num_prompt_tokens, tokens, ttft, time.monotonic() - self.t0)
        if self.first_token is not None:
            m.ttft.labels(label).observe(self.first_token - self.t0)
            if tokens > 1:
                m.tpot.labels(label).observe((time.monotonic() - self.first_token) / (tokens - 1))
        for adapter in self.target.adapters or (None,):
            self.state.traffic.record(adapter, tokens)

    def _usage_entry(self, status: str, completion: int) -> UsageEntry:
        """The usage record of this request: its `usage` numbers (none when it never ran), the prompt
        tokens served from the prefix cache (per prompt, the most any of its choices reused), latency."""
        ran = status != "rate_limited"
        cached: dict[int, int] = {}
        for c in self.gen.choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
        return usage_entry(
            self.target.key,
            self.target.adapter,
            self.target.digest,
            self.num_prompt_tokens if ran else 0,
            completion if ran else 0,
            min(sum(cached.values()), self.num_prompt_tokens) if ran else 0,
            time.monotonic() - self.t0,
            status,
        )

    async def collect(self) -> None:
        """Run to completion, aborting the engine requests if the client disconnects meanwhile: then one
        INFO line is logged and `ClientDisconnected` raised (its answer goes nowhere), not a traceback."""
        task = asyncio.current_task()
        watcher = asyncio.create_task(self._watch_disconnect(task))
        try:
            async for _ in self.updates():
                pass
        except asyncio.CancelledError:
            if not self.client_gone or task is None:
                raise  # cancelled by someone else (e.g. the server shutting down)
            task.uncancel()  # the cancellation was ours, to stop the engine requests; it is done
            log.info(
                "client disconnected before the answer to %s was ready; its engine request was aborted",
                self.gen.id,
            )
            raise ClientDisconnected() from None
        finally:
            watcher.cancel()
        self.gen.keep_best()

    async def _watch_disconnect(self, task: asyncio.Task | None) -> None:
        while True:
            await asyncio.sleep(0.25)
            if await self.request.is_disconnected():
                if task is not None:
                    self.client_gone = True
                    task.cancel()
                return


class ClientDisconnected(APIError):
    """The client hung up before its non-streamed answer was ready (answered as nginx's 499, which
    nobody receives: uvicorn drops what is sent on a closed connection)."""

    def __init__(self) -> None:
        super().__init__(
            499, "the client closed the connection before the answer", code="client_disconnected"
        )


def _choice_error(target: Target, status: int, error: str) -> APIError:
    """The API error for an engine request that ended with `error`: 404 `model_not_found` when the
    adapter was deleted before the engine admitted the request (as if the request came after)."""
    if status == 404:
        return APIError(
            404,
            f"The model '{target.model_name}' does not exist or is not active (it was removed)",
            param="model",
            code="model_not_found",
        )
    return APIError(status, f"generation failed: {error}")


def usage(gen: Generation, num_prompt_tokens: int) -> dict[str, Any]:
    """OpenAI `usage`: completion tokens count every generated token (best_of candidates too, as OpenAI
    bills them)."""
    completion = gen.num_generated_tokens
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
    }


def finish_reason(reason: str | None) -> str | None:
    return "length" if reason == "length" else ("stop" if reason is not None else None)
