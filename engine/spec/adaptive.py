"""Per-sequence adaptive `k`: speculate only while it pays, back off exponentially when it does not.

Each sequence estimates the probability `alpha` that one of its proposed tokens is accepted (geometric
model: a verification of k proposals that accepted `a < k` saw a accepts and one rejection; one that
accepted all k saw k accepts), from exponentially decayed counts plus a weak prior: the acceptance its
adapter's sequences have seen lately (`AdapterPrior`; acceptance depends mostly on the task, so a new
sequence on an adapter whose proposals are rarely accepted starts cautious). Given the engine's
current break-even probability `theta` (engine/spec/cost.py), the j-th proposal is worth its row when
alpha^j > theta, so

    k = max { j <= k_max : alpha^j > theta }

When k is 0 the sequence pauses for `backoff` steps, then probes with one proposal; a probe that is
rejected doubles the next pause (up to `max_backoff`), one that is accepted resets it. A new sequence
starts from its adapter's current pause, so short requests on an adapter whose proposals keep failing
do not each pay for their own probes. Steps where the proposer found nothing cost nothing and change
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.8  # weight of older verifications
_PRIOR_WEIGHT = 1.0  # pseudo-counts of the prior
_FIRST_ALPHA = 0.7  # before an adapter has any verification: optimistic enough to try k > 1


@dataclass(slots=True)
class AdapterPrior:
    """Decayed acceptance counts over all sequences of one adapter (or of the base model)."""

    accepts: float = 0.0
    rejects: float = 0.0
    backoff: int = 2  # the pause a new sequence of this adapter starts from (grows with failed probes)

    def alpha(self) -> float:
        total = self.accepts + self.rejects
        return _FIRST_ALPHA if total < 1 else self.accepts / total

    def record(self, proposed: int, accepted: int, probe: bool, max_backoff: int) -> None:
        """One verification on this adapter; `probe`: the sequence was probing after a pause."""
        self.accepts = 0.95 * self.accepts + accepted
        self.rejects = 0.95 * self.rejects + (1 if accepted < proposed else 0)
        if accepted:
            self.backoff = 2
        elif probe:
            self.backoff = min(self.backoff * 2, max_backoff)


@dataclass(slots=True)
class SpecState:
    k_max: int
    max_backoff: int = 64
    prior_alpha: float = _FIRST_ALPHA
    accepts: float = 0.0  # decayed counts of accepted and rejected proposals
    rejects: float = 0.0
    paused: int = 0  # steps left without speculation
    backoff: int = 2  # length of the next pause
    probing: bool = False  # the next step proposes one token to re-measure alpha
    proposed: int = 0  # totals, for statistics
    accepted: int = 0
    verifications: int = 0

    @property
    def alpha(self) -> float:
        """Estimated probability that a proposed token is accepted."""
        prior = _PRIOR_WEIGHT * self.prior_alpha
        return (self.accepts + prior) / (self.accepts + self.rejects + _PRIOR_WEIGHT)

    def next_k(self, theta: float) -> int:
        """How many tokens to propose this step (0: do not speculate now)."""
        if self.paused > 0:
            self.paused -= 1
            self.probing = self.paused == 0
            return 0
        if self.probing:
            return 1
        k, p = 0, self.alpha
        while k < self.k_max and p > theta:
            k += 1
            p *= self.alpha
        if k == 0:
            self.paused = self.backoff
            self.backoff = min(self.backoff * 2, self.max_backoff)
        return k

    def record(self, proposed: int, accepted: int) -> None:
        """One verification of `proposed` tokens accepted `accepted` of them."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        self.accepts = _DECAY * self.accepts + accepted
        self.rejects = _DECAY * self.rejects + (1 if accepted < proposed else 0)
        if self.probing:
            self.probing = False
            if accepted > 0:
                self.backoff = 2
