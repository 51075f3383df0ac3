"""build_lora_batch_meta: tokens grouped by slot with stable order, counts and starts."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_meta import build_lora_batch_meta


def test_groups_tokens_by_slot_stably() -> None:
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 5], dtype=torch.int32)
    meta = build_lora_batch_meta(slots)
    assert meta.token_indices_sorted.tolist() == [1, 5, 2, 0, 3, 4, 6]
    assert meta.slot_ids.tolist() == [-1, 0, 2, 5]
    assert meta.slot_token_counts.tolist() == [2, 1, 3, 1]
    assert meta.slot_token_starts.tolist() == [0, 2, 3, 6]
    assert (meta.num_tokens, meta.max_tokens_per_slot) == (7, 3)
    assert torch.equal(meta.token_slots, slots)
    for t in (meta.token_indices_sorted, meta.slot_ids, meta.slot_token_counts, meta.slot_token_starts):
        assert t.dtype == torch.int32


def test_empty_and_int64_input() -> None:
    meta = build_lora_batch_meta(torch.empty(0, dtype=torch.int64))
    assert (meta.num_tokens, meta.max_tokens_per_slot, meta.slot_ids.numel()) == (0, 0, 0)
    assert meta.token_slots.dtype == torch.int32


@pytest.mark.parametrize("bad", [torch.zeros(2, 2, dtype=torch.int32), torch.zeros(3), [0, 1]])
def test_rejects_bad_input(bad: object) -> None:
    with pytest.raises(ValueError, match="token_slots"):
        build_lora_batch_meta(bad)  # type: ignore[arg-type]
