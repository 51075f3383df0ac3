"""Plain data passed from the scheduler to the model runner and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import Logprob
from engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """`num_tokens` of `seq`, starting at token `start`, are computed this step.

    `sample` is True when the chunk reaches the sequence's last known token, so the step yields its next
    token; a partial prefill chunk only fills the KV cache. `spec_token_ids` (speculative decoding) are
    proposed tokens computed after the last known one: they are the last `len(spec_token_ids)` of the
    `num_tokens` rows, and the step yields 1 to len + 1 tokens for the sequence.
    """

    seq: Sequence
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_batched_tokens: int
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, Logprob] | None = None


@dataclass(slots=True)
class RunnerOutput:
    """One entry per `SchedulerOutput.scheduled` item: the sampled token, or None for a partial chunk.

    With speculative decoding, `spec_tokens[i]` (None for items without proposed tokens) lists every token
    item i emits this step (accepted proposals, then the target's own token); `sampled[i]` is its first."""

    sampled: list[SampledToken | None]
    spec_tokens: list[list[SampledToken] | None] | None = None

    def tokens(self, i: int) -> list[SampledToken]:
        """The tokens item i emits this step (none for a partial prefill chunk)."""
        if self.spec_tokens is not None and self.spec_tokens[i] is not None:
            return self.spec_tokens[i] or []
        tok = self.sampled[i]
        return [] if tok is None else [tok]
