"""What a speculative row costs, learned from the engine's own steps.

A step that computes R query rows takes about t(R) = a + b * R seconds. Adding one proposed token
costs one row (b seconds) and yields a token with the probability that it is accepted, alpha^j for
the j-th proposal. The engine currently makes `tokens_per_step / t_step` tokens per second, so the
j-th proposal pays when

    alpha^j > theta = b * tokens_per_step / t_step

On an accelerator decode is memory-bound, b is tiny and theta small: speculation almost always pays.
On a CPU running a small model a row costs real compute, theta approaches 1 as the batch grows, and only
sequences whose proposals are nearly always accepted keep speculating (engine/spec/adaptive.py).

a and b come from an exponentially weighted least-squares fit over recent steps (t against R); until
the steps have spread enough in R to fit, `theta` is `prior`.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.97  # weight of the past per step (a memory of about 30 steps)


@dataclass(slots=True)
class StepCostModel:
    prior: float = 0.2
    min_theta: float = 0.02
    max_theta: float = 0.95
    fixed_theta: float | None = None  # set: `theta` returns it whatever the timings (reproducible runs)
    w: float = 0.0  # decayed sums of 1, R, R^2, t, R*t and tokens
    sr: float = 0.0
    srr: float = 0.0
    st: float = 0.0
    srt: float = 0.0
    stok: float = 0.0

    def observe(self, rows: int, seconds: float, tokens: int) -> None:
        """One finished step: `rows` query rows computed in `seconds`, emitting `tokens` tokens."""
        if rows <= 0 or seconds <= 0:
            return
        d = _DECAY
        self.w = d * self.w + 1
        self.sr = d * self.sr + rows
        self.srr = d * self.srr + rows * rows
        self.st = d * self.st + seconds
        self.srt = d * self.srt + rows * seconds
        self.stok = d * self.stok + tokens

    def row_seconds(self) -> float | None:
        """b: the fitted cost of one more row (None while R has not varied enough to fit it)."""
        if self.w < 4:
            return None
        mean_r = self.sr / self.w
        var_r = self.srr / self.w - mean_r * mean_r
        if var_r < 0.25:
            return None
        cov = self.srt / self.w - mean_r * self.st / self.w
        return max(cov / var_r, 0.0)

    def theta(self) -> float:
        """The acceptance probability a proposed token needs for its row to pay (see the docstring)."""
        if self.fixed_theta is not None:
            return self.fixed_theta
        b = self.row_seconds()
        if b is None or self.st <= 0:
            return self.prior
        value = b * (self.stok / self.w) / (self.st / self.w)
        return min(self.max_theta, max(self.min_theta, value))
