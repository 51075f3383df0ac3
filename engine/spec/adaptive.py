"""Per-sequence adaptive `k`: speculate only while it pays, back off exponentially when it does not.

A verification step with `k` proposed tokens costs `k` extra query rows and yields `1 + accepted`
tokens. Each sequence keeps an exponential moving average of the tokens it accepts per verification:

    ema <- (1 - w) * ema + w * accepted
    next k = clamp(ceil(ema) + 1, 1, k_max)          (propose a little past what usually lands)
    if ema < min_accept: pause for `backoff` steps, then probe again with k = 1;
                         a probe that fails doubles `backoff` (up to max_backoff), one that pays resets it

Steps where the proposer found nothing cost nothing and change nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_WEIGHT = 0.5


@dataclass(slots=True)
class SpecState:
    k_max: int
    min_accept: float = 0.5
    max_backoff: int = 64
    ema: float = -1.0  # < 0: no verification yet (optimistic start at k_max)
    paused: int = 0  # steps left without speculation
    backoff: int = 2  # length of the next pause
    probing: bool = False  # the next verification decides whether the pause was right
    proposed: int = 0  # totals, for statistics
    accepted: int = 0
    verifications: int = 0

    def next_k(self) -> int:
        """How many tokens to propose this step (0: do not speculate now)."""
        if self.paused > 0:
            self.paused -= 1
            if self.paused == 0:
                self.probing = True
            return 0
        if self.probing:
            return 1
        if self.ema < 0:
            return self.k_max
        return max(1, min(self.k_max, math.ceil(self.ema) + 1))

    def record(self, proposed: int, accepted: int) -> None:
        """One verification of `proposed` tokens accepted `accepted` of them."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        if self.probing:
            self.probing = False
            if accepted == 0:
                self.paused = self.backoff
                self.backoff = min(self.backoff * 2, self.max_backoff)
                return
            self.backoff = 2
            self.ema = float(accepted)
            return
        self.ema = float(accepted) if self.ema < 0 else (1 - _WEIGHT) * self.ema + _WEIGHT * accepted
        if self.ema < self.min_accept:
            self.paused = self.backoff
            self.backoff = min(self.backoff * 2, self.max_backoff)
