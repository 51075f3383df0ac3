"""Applying allowed-token bitmasks to logits, and the sampler wrapper that does it before sampling.

A bitmask row holds one bit per token id (bit `t % 32` of int32 word `t // 32`; 1 = allowed), as
llguidance writes it. `apply_bitmask` sets every disallowed logit of the masked rows to -inf (and every
column beyond the mask's width); rows without a mask are not touched, so unconstrained requests sample
exactly what they would sample alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """int32 [R, W] bitmask -> bool [R, vocab] allowed (ids >= 32 * W are not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab]).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.cat(
            [allowed, torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool)], 1
        )
    return allowed


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """logits [S, V]; set logits[rows[i], t] = -inf where bit t of `bitmask[i]` is 0. In place; returns
    `logits`. A row whose mask allows nothing is left as it is (its matcher reports the error)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    allowed |= ~allowed.any(dim=1, keepdim=True)
    banned = (~allowed).to(logits.device, non_blocking=True)
    if rows == list(range(logits.shape[0])):
        return logits.masked_fill_(banned, float("-inf"))
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))


class MaskingSampler:
    """Wraps the engine's sampler: `masks(reqs)` gives (rows, bitmask) for the constrained rows, which
    are masked before the wrapped sampler runs. The wrapped sampler's contract is unchanged, so its
    log-probabilities are those of the masked distribution."""

    def __init__(self, inner: Callable[[torch.Tensor, list], Any], masks: Callable[[list], Any]) -> None:
        self.inner = inner
        self.masks = masks

    def __getattr__(self, name: str) -> Any:  # e.g. the wrapped sampler's generator
        return getattr(self.inner, name)

    def __call__(self, logits: torch.Tensor, reqs: list) -> Any:
        found = self.masks(reqs)
        if found is not None:
            rows, bitmask = found
            logits = apply_bitmask(logits, rows, bitmask)
        return self.inner(logits, reqs)
