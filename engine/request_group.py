"""A user's request as the engine reports it: one prompt, its `n` sequences, their text.

Each sequence's text comes from the shared output path (`SequenceText`: incremental detokenization and
stop strings); a stop string it reports finishes the sequence through the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.output_processor import SequenceText
from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    texts: list[SequenceText | None]
    n: int = 0  # choices reported: fewer than `seqs` under `best_of` (0: all)

    def detokenize(self, seq: Sequence, finish: Callable[[Sequence, SequenceStatus], None]) -> None:
        """Append the text of `seq`'s new tokens (several when speculative tokens were accepted), one at
        a time; on a stop string cut the text, drop the tokens after it, and `finish` the sequence."""
        text = self.texts[self.seqs.index(seq)]
        if text is None:
            return
        num_new = max(1, seq.num_new_tokens)  # > 1 when speculative tokens were accepted
        first = seq.num_output_tokens - num_new
        new = seq.output_token_ids[first:]
        engine_finish = seq.finish_reason if seq.is_finished else None
        for j, tok in enumerate(new):
            text.accept(tok, engine_finish if j == len(new) - 1 else None)
            if text.stop_hit is not None:
                seq.truncate_output(first + j + 1)
                break
        seq.text = text.text
        if text.stop_hit is None:
            return
        seq.stop_reason = text.stop_hit
        if seq.is_finished:  # length limit reached on the same token: the stop string wins
            seq.status = SequenceStatus.FINISHED_STOPPED
        else:
            finish(seq, SequenceStatus.FINISHED_STOPPED)

    def output(self) -> RequestOutput:
        """The request's state now: every sequence's tokens, text and finish reason. Under `best_of`
        (more sequences than `n`): nothing until all finish, then the `n` of highest cumulative
        log-probability, best first."""
        finished = all(s.is_finished for s in self.seqs)
        seqs = self.seqs
        if 0 < self.n < len(seqs):
            ranked = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
            seqs = ranked[: self.n] if finished else []
        comps = [
            CompletionOutput(
                index=i,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(seqs)
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=comps,
            finished=finished,
            num_cached_tokens=max(self.seqs[0].num_cached_tokens, 0),
        )
