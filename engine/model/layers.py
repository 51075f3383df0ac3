"""Pieces every decoder family shares: the forward pass's inputs (`ForwardBatch`) and RMSNorm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.model.linear import LoRAStepContext
from kernels.fused_cpu import FusedStep


@dataclass(slots=True)
class ForwardBatch:
    """Everything one forward pass reads besides the weights."""

    input_ids: torch.Tensor  # [T] int64, all sequences' new tokens concatenated
    positions: torch.Tensor  # [T] int64: rows of the RoPE tables (the token's position, see rope.py)
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: rows of the flat batch whose next-token logits are needed
    lora: LoRAStepContext | None = None  # None when no request in the step uses an adapter


class VocabLoRAHook(Protocol):
    """A step's embedding / LM-head LoRA (`engine/lora/vocab_step.py`, `VocabLoRAStep`)."""

    def embed(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Add each adapted token's embedding-LoRA delta into the lookups `x` in place."""
        ...

    def head(self, h: torch.Tensor, logits: torch.Tensor, logits_indices: torch.Tensor) -> None:
        """Add the LM-head-LoRA delta into the logits rows of adapted requests in place."""
        ...


def vocab_lora(batch: ForwardBatch | None) -> VocabLoRAHook | None:
    """The step's embedding / LM-head LoRA, or None when no adapter of the step has one."""
    hook = getattr(batch.lora, "vocab", None) if batch is not None else None
    return hook if hook else None


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def fused(self, step: FusedStep, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """CPU: ``residual += delta`` in place (if given), then return ``forward(residual)``, in one pass."""
        return step.add_rms_norm(residual, delta, self.weight, self.eps)
