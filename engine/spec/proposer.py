"""The one interface every proposer implements (n-gram lookup, draft model)."""

from __future__ import annotations

from typing import Protocol

from engine.sequence import Sequence


class Proposer(Protocol):
    """Guesses the next tokens of sequences; the target model verifies the guesses in its next step."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """For each sequence, up to `ks[i]` tokens likely to follow `seqs[i].all_token_ids` (maybe none).

        Called after a step for the running sequences whose next step is a decode; `ks[i] >= 1`."""
        ...

    def retain(self, alive: set[str]) -> None:
        """Forget per-sequence state of every sequence not in `alive` (ids of the running sequences:
        the others finished, were aborted or preempted)."""
        ...
