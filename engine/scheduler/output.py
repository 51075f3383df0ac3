"""Plain data passed from the scheduler to the model runner and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import Logprob
from engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """`num_tokens` of `seq`, starting at token `start`, are computed this step.

    `sample` is True when the chunk reaches the sequence's last known token, so the step yields its next
    token; a partial prefill chunk only fills the KV cache.
    """

    seq: Sequence
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool


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
    """One entry per `SchedulerOutput.scheduled` item: the sampled token, or None for a partial chunk."""

    sampled: list[SampledToken | None]
