"""One API request's generation: fan out prompts × n to the engine and follow each choice's output.

Each choice is one engine request, fanned out by `SamplingParams.choices()` as `LLMEngine` does for `n`
(choice j: `n=1`, seed + j; prompt blocks are shared through the engine's prefix cache). Tokens arrive as
ids; each choice's text, stop strings, finish reason and streaming hold-back come from the engine's one
output path (`SequenceText.accept`), and a stop string ends the choice (leaving the engine stream aborts
that engine request). Per-token log-probabilities keep the
token's own bytes and its offset in the returned text.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from api.engine_client import EngineClient
from api.engine_protocol import AddRequest, RequestDelta
from engine.lora_request import LoRARequest
from engine.output_processor import SequenceText
from engine.sampling_params import SamplingParams
from engine.tokenizer import token_bytes, token_text


@dataclass(slots=True)
class TokenInfo:
    """One token as a client sees it: text (with `\\xNN` for a partial character) and own bytes."""

    text: str
    raw: bytes


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's log-probability, the k most likely tokens at its position (rank order) and
    where its text starts in the choice's returned text."""

    token: TokenInfo
    logprob: float
    top: list[tuple[TokenInfo, float]]
    text_offset: int


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    out: SequenceText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.out.text


@dataclass(slots=True)
class ChoiceUpdate:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool


class Generation:
    """Runs all choices of one request and yields `ChoiceUpdate`s as they progress."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        prompts: list[list[int]],
        params: SamplingParams,
        lora: LoRARequest | None,
        priority: int = 0,
    ) -> None:
        self.client, self.tokenizer, self.prompts = client, tokenizer, prompts
        self.params, self.n, self.lora, self.priority = params, params.n, lora, priority
        self.width = params.best_of or params.n  # sequences per prompt (best_of candidates, else n)
        self.id = uuid.uuid4().hex
        self.choices = [
            Choice(
                index=p * self.width + j,
                prompt_index=p,
                out=SequenceText(tokenizer, params.stop, params.min_tokens),
            )
            for p in range(len(prompts))
            for j in range(self.width)
        ]
        self.discarded: list[Choice] = []  # best_of candidates not returned (`keep_best`)
        self._per_choice = params.choices()
        self._token_info = lru_cache(maxsize=4096)(self._describe)

    def _engine_request(self, choice: Choice) -> AddRequest:
        return AddRequest(
            request_id=f"{self.id}-{choice.index}",
            prompt_token_ids=self.prompts[choice.prompt_index],
            params=self._per_choice[choice.index % self.width],
            lora=self.lora,
            priority=self.priority,
        )

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated for this request, best_of candidates not returned included."""
        return sum(len(c.token_ids) for c in (*self.choices, *self.discarded))

    def keep_best(self) -> None:
        """Under `best_of` (more candidates than `n` per prompt), once all finished: keep per prompt the
        `n` of highest cumulative log-probability (best first, indices renumbered `p * n + rank`)."""
        if self.width == self.n:
            return
        kept: list[Choice] = []
        for p in range(len(self.prompts)):
            group = [c for c in self.choices if c.prompt_index == p]
            group.sort(key=lambda c: sum(lp.logprob for lp in c.logprobs), reverse=True)
            for rank, c in enumerate(group[: self.n]):
                c.index = p * self.n + rank
                kept.append(c)
            self.discarded.extend(group[self.n :])
        self.choices = kept

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
        last = len(delta.token_ids) - 1
        engine_finish = delta.finish_reason if delta.finish_reason in ("stop", "length") else None
        for i, tok in enumerate(delta.token_ids):
            choice.token_ids.append(tok)
            if delta.logprobs is not None:
                lp = self._logprob(delta.logprobs[i], len(choice.out.text))
                choice.logprobs.append(lp)
                new_lps.append(lp)
            choice.out.accept(tok, engine_finish if i == last else None)
            if choice.out.stopped:
                choice.finish_reason = "stop"
                break
        if choice.finish_reason is None and delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.error = delta.error
            choice.error_status = delta.error_status
        finished = choice.finish_reason is not None
        text = choice.out.releasable(finished)
        return ChoiceUpdate(choice, text, choice.token_ids[first_new:], new_lps, finished)

    def _logprob(self, entries: list[tuple[int, float, int]], offset: int) -> TokenLogprob:
        """`entries`: the chosen token first, then the top tokens, each (id, logprob, rank)."""
        chosen_id, chosen_lp, _ = entries[0]
        k = self.params.logprobs or 0
        top = sorted(entries, key=lambda e: e[2])[:k]
        return TokenLogprob(
            self._token_info(chosen_id), chosen_lp, [(self._token_info(t), v) for t, v, _ in top], offset
        )

    def _describe(self, token_id: int) -> TokenInfo:
        if self.tokenizer is None:
            return TokenInfo(f"token_id:{token_id}", b"")
        raw = token_bytes(self.tokenizer, token_id)
        return TokenInfo(token_text(raw), raw)
