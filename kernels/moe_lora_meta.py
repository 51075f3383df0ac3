"""The expert-LoRA inputs of the fused-MoE kernel (`kernels/fused_moe.py`, `kernels/moe_lora.py`) and of
its reference: each token's adapter index and, per expert projection, one layer's adapter pages with
each adapter's page ids and scaling. Plain tensors, no Triton: the engine builds them
(`engine/lora/expert_step.py`) and the reference reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels._common import FLOAT_DTYPES, check_shape, check_tensor

_OP = "fused_moe_lora"


@dataclass(slots=True)
class ExpertLoRAWeights:
    """One layer's expert LoRA of one projection ("gate_up" or "down") for the step's adapters."""

    a: Tensor  # [num_pages, E, R, in]: A pages (a layer's view of the pool), last dim contiguous
    b: Tensor  # [num_pages, E, out, R]: B pages, last dim contiguous
    pages: Tensor  # [num_adapters, max_pages] int32: each adapter's page ids, -1 past its rank (or none)
    scale: Tensor  # [num_adapters] float32: each adapter's scaling on this projection


@dataclass(slots=True)
class MoELoRA:
    """The step's expert LoRA on one MoE layer: each token's adapter and each projection's weights."""

    token_adapter: Tensor  # [T] int: each token's adapter index, num_adapters for tokens without one
    num_adapters: int
    gate_up: ExpertLoRAWeights | None  # None: no adapter of the step has LoRA on this projection here
    down: ExpertLoRAWeights | None

    @property
    def groups(self) -> int:
        """Adapter groups per expert: the adapters and the rows without one."""
        return self.num_adapters + 1


def group_ids(topk_ids: Tensor, lora: MoELoRA | None) -> Tensor:
    """[T, k] the pairs' group ids: the expert ids without LoRA, else `e * (A + 1) + token_adapter[t]`."""
    if lora is None:
        return topk_ids
    return topk_ids.long() * lora.groups + lora.token_adapter.long().unsqueeze(1)


def check_lora(lora: MoELoRA, num_tokens: int, num_experts: int, fin: dict, fout: dict, dev) -> None:
    """ValueError unless `lora` fits a layer of `num_experts` experts over `num_tokens` tokens; `fin` /
    `fout`: in / out features by projection name."""
    check_tensor(
        _OP, "token_adapter", lora.token_adapter, ndim=1, dtypes=(torch.int32, torch.int64), device=dev
    )
    check_shape(_OP, "token_adapter", lora.token_adapter, (num_tokens,))
    for name in ("gate_up", "down"):
        w: ExpertLoRAWeights | None = getattr(lora, name)
        if w is None:
            continue
        check_tensor(_OP, f"{name}.a", w.a, ndim=4, dtypes=FLOAT_DTYPES, device=dev)
        check_tensor(_OP, f"{name}.b", w.b, ndim=4, dtypes=(w.a.dtype,), device=dev)
        rank = w.a.shape[2]
        check_shape(_OP, f"{name}.a", w.a, (None, num_experts, None, fin[name]))
        check_shape(_OP, f"{name}.b", w.b, (w.a.shape[0], num_experts, fout[name], rank))
        check_tensor(_OP, f"{name}.pages", w.pages, ndim=2, dtypes=(torch.int32,), device=dev)
        check_shape(_OP, f"{name}.pages", w.pages, (lora.num_adapters, None))
        check_tensor(_OP, f"{name}.scale", w.scale, ndim=1, dtypes=(torch.float32,), device=dev)
        check_shape(_OP, f"{name}.scale", w.scale, (lora.num_adapters,))
