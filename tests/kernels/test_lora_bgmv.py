"""The fused BGMV LoRA kernel (interpreted) vs `kernels.reference.lora_shrink_expand_ref` on every shape
class: decode 1-row segments, multi-row segments under a smaller grid, mixed ranks 1..128 (rank chunks),
slot -1 rows (NaN: never read), packed slices of different widths, random page tables over NaN pools."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.lora_bgmv import bgmv_config, lora_bgmv
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.reference import lora_shrink_expand_ref
from kernels.tuning import set_config_hook
from tests.kernels.lora_case import LoRACase, dense_expand, dense_shrink, make_case
from tests.kernels.test_lora_ops import DECODE_SLOTS, H_IN, H_OUTS, MIXED_RANKS, PREFILL_SLOTS

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


def _run(case: LoRACase, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y before, y after the kernel, y after the reference)."""
    gen = torch.Generator().manual_seed(seed)
    y0 = torch.randn(case.x.shape[0], sum(H_OUTS), generator=gen).to(case.x.dtype)
    y, ref = y0.clone(), y0.clone()
    args = (case.a_pools, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta)
    lora_bgmv(case.x, *args, y)
    lora_shrink_expand_ref(case.x, *args, ref)
    return y0, y, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("token_slots", "page_rank"),
    [(DECODE_SLOTS, 16), (DECODE_SLOTS, 8), ([2], 8), ([3, 3, -1, 0, 5, 5, 5, 1], 4)],
    ids=["decode-p16", "decode-p8", "one", "few-rows"],
)
def test_bgmv_matches_reference(token_slots: list[int], page_rank: int, dtype: torch.dtype) -> None:
    case = make_case(MIXED_RANKS, token_slots, H_IN, H_OUTS, page_rank, dtype)
    y0, y, ref = _run(case)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol)
    no_adapter = case.meta.token_slots < 0
    assert torch.equal(y[no_adapter], y0[no_adapter])  # untouched, bit for bit
    assert not torch.equal(y[~no_adapter], y0[~no_adapter])


def test_reference_composition_matches_dense_oracle() -> None:
    case = make_case(MIXED_RANKS, PREFILL_SLOTS, H_IN, H_OUTS, 8, torch.float32)
    y0, _, ref = _run(case)
    torch.testing.assert_close(ref, dense_expand(case, dense_shrink(case), y0), rtol=1e-5, atol=1e-5)


def test_bgmv_equals_sgmv_shrink_then_expand() -> None:
    """On a prefill-shaped batch too (long segments loop over row blocks): the two kernel paths agree."""
    case = make_case(MIXED_RANKS, PREFILL_SLOTS, H_IN, H_OUTS, 8, torch.float32)
    y0, y, _ = _run(case)
    v = torch.empty(3, case.x.shape[0], case.max_rank)
    sgmv = y0.clone()
    lora_shrink(case.x, case.a_pools, case.page_table, case.ranks, case.meta, v)
    lora_expand(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, sgmv)
    torch.testing.assert_close(y, sgmv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_M": 2, "BLOCK_R": 8, "BLOCK_K": 16, "BLOCK_N": 16, "N_SPLIT": 4},  # rank chunks, col splits
        {"BLOCK_M": 1, "BLOCK_R": 32, "BLOCK_K": 64, "BLOCK_N": 64, "N_SPLIT": 1},
    ],
)
def test_tuned_blocks_and_a_grid_smaller_than_the_segments(cfg: dict) -> None:
    """A CUDA graph sizes the grid before it knows the counts (`grid_tokens_per_slot`): segments of 11
    and 5 rows under a 1-row grid loop over their rows; forced small tiles split rank and columns."""
    slots = [2] * 11 + [0] * 5 + [-1] * 3 + [4]
    case = make_case(MIXED_RANKS, slots, H_IN, H_OUTS, 8, torch.float32)
    case.meta = dataclasses.replace(case.meta, grid_tokens_per_slot=1)
    seen: list[dict] = []

    def hook(op: str, problem: dict) -> dict:
        seen.append(dict(problem))
        return cfg

    previous = set_config_hook(hook)
    try:
        _, y, ref = _run(case)
    finally:
        set_config_hook(previous)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert seen == [
        {
            "max_tokens_per_slot": 1,
            "h_in": H_IN,
            "max_h_out": max(H_OUTS),
            "max_rank": case.max_rank,
            "num_slices": 3,
            "num_segments": 4,
        }
    ]


def test_no_adapter_rows_and_empty_batches_cost_nothing() -> None:
    case = make_case(MIXED_RANKS, [-1, -1, -1], H_IN, H_OUTS, 8, torch.float32)
    y0, y, _ = _run(case)
    assert torch.equal(y, y0)
    empty = make_case(MIXED_RANKS, [], H_IN, H_OUTS, 8, torch.float32)
    y0, y, _ = _run(empty)
    assert y.shape == (0, sum(H_OUTS))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the swapped pages reach the NaN padding
def test_swapped_page_table_is_detected() -> None:
    """The comparison can fail: another adapter's pages give another result."""
    case = make_case(MIXED_RANKS, DECODE_SLOTS, H_IN, H_OUTS, 8, torch.float32)
    _, good, _ = _run(case)
    case.page_table[:, [2, 3]] = case.page_table[:, [3, 2]]
    _, bad, _ = _run(case)
    assert not torch.allclose(bad, good, atol=1e-3)


def test_config_splits_columns_for_few_segments() -> None:
    one = bgmv_config(1, 2048, 2048, 16, 3, 1)
    many = bgmv_config(1, 2048, 2048, 16, 3, 256)
    assert one["N_SPLIT"] > many["N_SPLIT"] == 1
    assert one["BLOCK_M"] == 2 and bgmv_config(16, 2048, 2048, 16, 3, 1)["BLOCK_M"] == 8
    assert one["BLOCK_K"] == 256 and bgmv_config(8, 2048, 2048, 16, 3, 1)["BLOCK_K"] == 64


CASE = make_case([[4, 8], [8, 0]], [0, 1, -1], 16, [16, 8], 8, torch.float32)


def _call(**kw) -> None:
    args = dict(x=CASE.x, a_pools=CASE.a_pools, b_pools=CASE.b_pools, page_table=CASE.page_table)
    args.update(ranks=CASE.ranks, scalings=CASE.scalings, meta=CASE.meta, y=torch.zeros(3, 24))
    args.update(kw)
    lora_bgmv(**args)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(x=CASE.x.long()), "x has dtype"),
        (dict(y=torch.zeros(3, 24, dtype=torch.float16)), "y has dtype"),
        (dict(y=torch.zeros(3, 20)), "y has shape"),
        (dict(a_pools=CASE.a_pools[:1]), "one pool per slice"),
        (dict(x=CASE.x[:, :8]), r"a_pools\[0\] has shape"),
        (dict(b_pools=[CASE.b_pools[0], CASE.b_pools[1][:, :, :4]]), r"b_pools\[1\] has shape"),
        (dict(page_table=CASE.page_table.long()), "page_table has dtype"),
        (dict(ranks=CASE.ranks[:1]), "ranks has shape"),
        (dict(scalings=CASE.scalings.double()), "scalings has dtype"),
        (dict(x=CASE.x[:2], y=torch.zeros(2, 24)), "meta has 3 tokens"),
    ],
)
def test_launcher_rejects(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call(**kw)
