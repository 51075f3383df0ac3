"""Attention with soft-capped scores, computed explicitly: SDPA has no soft-capping (Gemma 2's
`attn_logit_softcapping`), so the torch paths take this for a soft-capped layer."""

from __future__ import annotations

import torch


def masked_attention(q, k, v, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """SDPA's result with soft-capped scores: q [..., Q, D], k/v [..., L, D] (same heads), mask [..., Q, L]
    bool (True = visible) or additive 0 / -inf; softmax(cap(scale * q kᵀ) + mask) v, computed in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    hidden = ~mask if mask.dtype == torch.bool else mask == float("-inf")
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
