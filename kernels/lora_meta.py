"""Per-step LoRA batch metadata: tokens grouped by adapter slot, shared by every layer's LoRA ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class LoRABatchMeta:
    """Tokens of one engine step grouped by adapter slot (SGMV segments).

    Segment ``i`` is slot ``slot_ids[i]`` and covers
    ``token_indices_sorted[slot_token_starts[i] : slot_token_starts[i] + slot_token_counts[i]]``.
    """

    token_indices_sorted: Tensor  # [T] int32: token indices ordered by slot (stable sort)
    slot_ids: Tensor  # [S] int32: distinct slots in the batch, ascending; may include -1 (= no adapter)
    slot_token_counts: Tensor  # [S] int32: tokens per entry of slot_ids
    slot_token_starts: Tensor  # [S] int32: offset of each entry's first token in token_indices_sorted
    num_tokens: int  # T
    max_tokens_per_slot: int  # max of slot_token_counts (0 when T == 0); sizes kernel grids
    token_slots: Tensor  # [T] int32: the input, slot per token in original order
    # Rows of each segment the kernel grids cover (0: max_tokens_per_slot); the kernels loop over a longer
    # segment's further rows. A CUDA graph sizes its grids before it knows the counts (decode_graphs.py).
    grid_tokens_per_slot: int = 0

    @property
    def grid_tokens(self) -> int:
        """Rows per segment that the shrink/expand grids are sized for."""
        return self.grid_tokens_per_slot or self.max_tokens_per_slot


def build_lora_batch_meta(token_slots: Tensor) -> LoRABatchMeta:
    """Group tokens by adapter slot.

    ``token_slots[t]`` is the pool slot of token ``t``'s adapter, ``-1`` for none. Pseudo-code::

        order = stable_argsort(token_slots); slot_ids, counts = run_lengths(token_slots[order])
        starts = exclusive_cumsum(counts)

    Synchronizes once with the device (to read ``max_tokens_per_slot``); call once per step.
    """
    if not isinstance(token_slots, Tensor):
        raise ValueError(
            f"build_lora_batch_meta: token_slots must be a Tensor, got {type(token_slots).__name__}"
        )
    if token_slots.dim() != 1:
        raise ValueError(
            f"build_lora_batch_meta: token_slots must be 1-D, got shape {tuple(token_slots.shape)}"
        )
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"build_lora_batch_meta: token_slots must be int32 or int64, got {token_slots.dtype}"
        )
    token_slots = token_slots.to(torch.int32)
    num_tokens = token_slots.numel()
    sorted_slots, order = torch.sort(token_slots, stable=True)
    slot_ids, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    max_tokens = int(counts.max().item()) if num_tokens > 0 else 0
    return LoRABatchMeta(
        token_indices_sorted=order.to(torch.int32),
        slot_ids=slot_ids.to(torch.int32),
        slot_token_counts=counts.to(torch.int32),
        slot_token_starts=starts.to(torch.int32),
        num_tokens=num_tokens,
        max_tokens_per_slot=max_tokens,
        token_slots=token_slots,
    )
