"""One generation request run to its end (`RequestRun`): admitted under the caller's limits and fair share,
its engine failures turned into API errors, a vanished client's engine requests aborted, and its metrics,
usage and traffic recorded once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request

from api.admission import ARRIVED, client_id
from api.engine_client import (
    EngineDeadError,
    EngineStalledError,
    EngineUnavailableError,
    ServerShuttingDownError,
)
from api.errors import APIError
from api.generation import ChoiceUpdate, Generation
from api.limits.limiter import Grant
from api.targets import Target
from api.usage.service import usage_entry
from lora_registry.usage import UsageEntry

log = logging.getLogger("loraplex.requests")


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
