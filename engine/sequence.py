"""One generated sequence as the scheduler sees it: tokens, how many of them have KV computed, and its status.

There are no prefill/decode phases: a sequence has `num_tokens` (prompt + generated) and
`num_computed_tokens` (those whose K/V sit in the cache). Each step schedules some of the difference.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.lora_request import LoRARequest
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.spec.adaptive import SpecState


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Sequence:
    """One sequence being generated (a prompt with `n > 1` becomes `n` of these, sharing prompt blocks
    through the prefix cache)."""

    seq_id: str  # the request id, with `#i` appended for the i-th of `n > 1` sequences
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_request: LoRARequest | None = None
    lora_key: str | None = None  # content digest of the adapter (of a mix: `mix_key`); prefix-cache key
    max_total_tokens: int = 0  # prompt + max_tokens, capped by the model's context
    lora_keys: tuple[str, ...] = ()  # digests of every adapter its rows use (a mix's members), once known

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 = not scheduled yet
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_lora_skips: int = 0  # times admission passed over it because max_loras adapters were running
    num_admission_bypasses: int = 0  # steps deferred by resident-first admission (scheduler/admission.py)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    text: str = ""
    first_token_time: float | None = None
    structured: Any = None  # the grammar matcher of a constrained sequence (engine.structured)
    num_new_tokens: int = 0  # tokens appended by the last step (> 1 when speculative tokens were accepted)
    spec_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (speculative)
    spec: SpecState | None = None  # adaptive speculation state (engine/spec/adaptive.py)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def adapter_keys(self) -> tuple[str, ...]:
        """Digests of the adapters this sequence's rows apply (a mix's members; none for the base model or
        while its digests are not known)."""
        if self.lora_keys:
            return self.lora_keys
        return (self.lora_key,) if self.lora_key is not None else ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop generated tokens after the first `num_output_tokens` (a stop string ended the sequence
        inside a step that accepted several tokens), with their logprobs; only for a finished sequence."""
        drop = self.output_token_ids[num_output_tokens:]
        if not drop:
            return
        if self.logprobs is not None:
            for tok, entry in zip(drop, self.logprobs[num_output_tokens:], strict=False):
                if tok in entry:
                    self.cumulative_logprob -= entry[tok].logprob
            del self.logprobs[num_output_tokens:]
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
