"""One API request's generation: fan out prompts × n to the engine, detokenize, apply stop strings.

Each choice is one engine request (prompt blocks are shared through the engine's prefix cache). Tokens
arrive as ids; this module turns them into text incrementally, cuts at the first stop string (aborting
that engine request), holds back text that may still become a stop string while streaming, and keeps
per-token log-probabilities.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from api.engine_client import EngineClient
from api.engine_protocol import AddRequest, RequestDelta
from engine.lora_request import LoRARequest
from engine.tokenizer import IncrementalDetokenizer, find_stop


@dataclass(slots=True)
class SamplingSpec:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    priority: int = 0


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    detok: IncrementalDetokenizer | None
    stops: list[str]
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0

    def releasable(self) -> str:
        """Text that can be streamed now: all of it once finished, else all but a possible stop prefix."""
        end = len(self.text) if self.finish_reason else len(self.text) - _held_back(self.text, self.stops)
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out


@dataclass(slots=True)
class ChoiceUpdate:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Generation:
    """Runs all choices of one request and yields `ChoiceUpdate`s as they progress."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        prompts: list[list[int]],
        spec: SamplingSpec,
        n: int,
        lora: LoRARequest | None,
    ) -> None:
        self.client, self.tokenizer, self.prompts, self.spec, self.n, self.lora = (
            client,
            tokenizer,
            prompts,
            spec,
            n,
            lora,
        )
        self.id = uuid.uuid4().hex
        self.choices = [
            Choice(
                index=p * n + j,
                prompt_index=p,
                detok=IncrementalDetokenizer(tokenizer) if tokenizer is not None else None,
                stops=spec.stop,
            )
            for p in range(len(prompts))
            for j in range(n)
        ]

    def _engine_request(self, choice: Choice) -> AddRequest:
        s = self.spec
        j = choice.index % self.n
        return AddRequest(
            request_id=f"{self.id}-{choice.index}",
            prompt_token_ids=self.prompts[choice.prompt_index],
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=None if s.seed is None else s.seed + j,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            lora_name=self.lora.name if self.lora else None,
            lora_path=self.lora.path if self.lora else None,
            lora_digest=self.lora.digest if self.lora else None,
            priority=s.priority,
        )

    async def stream(self) -> AsyncIterator[ChoiceUpdate]:
        """Updates of all choices, interleaved as tokens arrive; errors from the engine propagate."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, queue)) for c in self.choices]
        pending = len(tasks)
        try:
            while pending:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    pending -= 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def _pump(self, choice: Choice, queue: asyncio.Queue) -> None:
        try:
            async for delta in self.client.generate(self._engine_request(choice)):
                update = self._apply(choice, delta)
                queue.put_nowait(update)
                if update.finished:
                    break  # leaving the generator aborts the engine request if it is still running
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the route
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    def _apply(self, choice: Choice, delta: RequestDelta) -> ChoiceUpdate:
        new_lps: list[TokenLogprob] = []
        first_new = len(choice.token_ids)
        choice.num_cached_tokens = max(choice.num_cached_tokens, delta.num_cached_tokens)
        for i, tok in enumerate(delta.token_ids):
            choice.token_ids.append(tok)
            if delta.logprobs is not None:
                entries = delta.logprobs[i]
                lp = TokenLogprob(
                    self.token_text(tok), entries[0][1], [(self.token_text(t), v) for t, v, _ in entries[1:]]
                )
                choice.logprobs.append(lp)
                new_lps.append(lp)
            if choice.detok is not None:
                piece = choice.detok.push(tok)
                choice.text += piece
                if choice.stops and piece:
                    hit = find_stop(choice.text, len(piece), choice.stops)
                    if hit is not None:
                        choice.text = choice.text[: hit[0]]
                        choice.finish_reason = "stop"
                        break
        if choice.finish_reason is None and delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.error = delta.error
        finished = choice.finish_reason is not None
        return ChoiceUpdate(choice, choice.releasable(), choice.token_ids[first_new:], new_lps, finished)

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])
