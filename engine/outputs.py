"""What the engine returns: one `RequestOutput` per prompt holding `n` `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token (under the model's raw distribution) and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sampled continuation. `logprobs[i]` maps token id -> `Logprob` for the i-th generated token:
    the chosen token plus the requested number of top alternatives."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """State of one request after a step: the prompt and every completion so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request was ended by an error (e.g. its adapter failed to load)
    refused: bool = False  # with `error`: the request itself can never be served (a client error, HTTP 400)
    metrics: dict[str, float] = field(default_factory=dict)
    kv_export: Any = None  # a prefill-only request's `engine.kv_transfer.KVExport` (finish "kv_transfer")
