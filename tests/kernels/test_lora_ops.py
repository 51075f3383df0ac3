"""Triton SGMV shrink/expand (interpreted) vs the torch reference, and the reference vs a dense oracle."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.reference import lora_expand_ref, lora_shrink_ref
from kernels.tuning import set_config_hook
from tests.kernels.lora_case import LoRACase, dense_expand, dense_shrink, make_case

H_IN = 40  # not a power of two: exercises K masking
H_OUTS = [40, 24, 16]  # q|k|v-like slices of different widths
# Slot ranks per slice: ranks 1, 4, 8, 16, 64, 128 mixed; slot 6 targets only slice 0; slot 7 gets no tokens.
MIXED_RANKS = [
    [1, 4, 8, 16, 64, 128, 4, 8],
    [8, 4, 1, 16, 64, 128, 0, 8],
    [16, 128, 64, 8, 4, 1, 0, 8],
]
PREFILL_SLOTS = [3, -1, 0, 5, 5, 1, 2, -1, 4, 6] * 4 + [5, 5, 5, 0, 0, 3]  # 46 tokens, slot 7 absent
DECODE_SLOTS = [4, 0, -1, 6, 1, 5, 2, 3]  # one token per adapter
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2)}


def _shrink_both(case: LoRACase) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (len(case.a_pools), case.x.shape[0], case.max_rank)
    out = torch.full(shape, 123.0)  # garbage: the op must overwrite everything
    ref = torch.full(shape, -5.0)
    lora_shrink(case.x, case.a_pools, case.page_table, case.ranks, case.meta, out)
    lora_shrink_ref(case.x, case.a_pools, case.page_table, case.ranks, case.meta, ref)
    return out, ref


def _expand_both(
    case: LoRACase, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_slices, num_tokens = len(case.b_pools), case.x.shape[0]
    v = torch.randn(num_slices, num_tokens, case.max_rank, generator=gen)
    for s in range(num_slices):  # entries the op must not read are NaN
        for t, slot in enumerate(case.meta.token_slots.tolist()):
            r = int(case.ranks[s, slot]) if slot >= 0 else 0
            v[s, t, r:] = float("nan")
    y0 = torch.randn(num_tokens, sum(H_OUTS), generator=gen).to(case.x.dtype)
    y, ref = y0.clone(), y0.clone()
    lora_expand(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, y)
    lora_expand_ref(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, ref)
    return v, y0, y, ref


def _both_ops_exact_under(hook, case: LoRACase) -> torch.Tensor:
    """Run shrink and expand with the tuning `hook` installed, assert both equal the reference, and
    return the shrink output."""
    previous = set_config_hook(hook)
    try:
        out, ref = _shrink_both(case)
        _, _, y, ref_y = _expand_both(case)
    finally:
        set_config_hook(previous)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("token_slots", "page_rank"),
    [(PREFILL_SLOTS, 8), (DECODE_SLOTS, 16), ([2], 8)],
    ids=["prefill", "decode", "one"],
)
def test_shrink_matches_reference(token_slots: list[int], page_rank: int, dtype: torch.dtype) -> None:
    case = make_case(MIXED_RANKS, token_slots, H_IN, H_OUTS, page_rank, dtype)
    out, ref = _shrink_both(case)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    no_adapter = case.meta.token_slots < 0
    assert torch.all(out[:, no_adapter] == 0)
    assert out.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("token_slots", "page_rank"),
    [(PREFILL_SLOTS, 8), (DECODE_SLOTS, 16), ([2], 8)],
    ids=["prefill", "decode", "one"],
)
def test_expand_matches_reference(token_slots: list[int], page_rank: int, dtype: torch.dtype) -> None:
    case = make_case(MIXED_RANKS, token_slots, H_IN, H_OUTS, page_rank, dtype)
    _, y0, y, ref = _expand_both(case)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol)
    no_adapter = case.meta.token_slots < 0
    assert torch.equal(y[no_adapter], y0[no_adapter])  # untouched, bit for bit
    assert not torch.equal(y, y0)


def test_reference_matches_dense_oracle() -> None:
    case = make_case(MIXED_RANKS, PREFILL_SLOTS, H_IN, H_OUTS, 8, torch.float32)
    _, ref = _shrink_both(case)
    torch.testing.assert_close(ref, dense_shrink(case), rtol=1e-5, atol=1e-5)
    v, y0, _, ref_y = _expand_both(case)
    torch.testing.assert_close(ref_y, dense_expand(case, v, y0), rtol=1e-5, atol=1e-5)


@pytest.mark.xfail(
    reason="Triton 3.9 interpreter bug: tl.dot on bf16 multiplies the raw uint16 bits", strict=False
)
def test_bfloat16_round_trip() -> None:
    """bf16 is checked on CUDA by bench/kernels/triton_gpu.py; the interpreter cannot run a bf16 tl.dot."""
    case = make_case(MIXED_RANKS, DECODE_SLOTS, H_IN, H_OUTS, 8, torch.bfloat16)
    out, ref = _shrink_both(case)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    _, _, y, ref_y = _expand_both(case)
    torch.testing.assert_close(y.float(), ref_y.float(), rtol=8e-2, atol=8e-2)


def test_no_adapter_tokens_cost_nothing() -> None:
    case = make_case(MIXED_RANKS, [-1, -1, -1], H_IN, H_OUTS, 8, torch.float32)
    out, _ = _shrink_both(case)
    assert torch.all(out == 0)
    _, y0, y, _ = _expand_both(case)
    assert torch.equal(y, y0)


def test_empty_batch() -> None:
    case = make_case(MIXED_RANKS, [], H_IN, H_OUTS, 8, torch.float32)
    out, ref = _shrink_both(case)
    assert out.shape == ref.shape == (3, 0, 128)


@pytest.mark.parametrize("split_k", [2, 4])
def test_tuned_config_hook_split_k_and_small_blocks(split_k: int) -> None:
    """Split-K (atomic partial sums) and many N blocks, forced through the tuning hook."""
    seen: list[tuple[str, dict]] = []

    def hook(op: str, problem: dict) -> dict:
        seen.append((op, dict(problem)))
        if op == "lora_shrink":
            return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": split_k}
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}

    case = make_case(MIXED_RANKS, PREFILL_SLOTS[:14], H_IN, H_OUTS, 8, torch.float32)
    _both_ops_exact_under(hook, case)
    assert [op for op, _ in seen] == ["lora_shrink", "lora_expand"]
    assert seen[0][1]["h_in"] == H_IN and seen[1][1]["max_h_out"] == max(H_OUTS)


@pytest.mark.parametrize("split_k", [1, 2])
def test_grids_smaller_than_a_segment_loop_over_its_rows(split_k: int) -> None:
    """A CUDA graph sizes grids for `grid_tokens_per_slot` rows per segment before it knows the counts:
    the kernels must cover a segment of 40 rows (3 row blocks of 16) by looping, and stay exact."""
    slots = [2] * 40 + [0] * 5 + [-1] * 3 + [5] * 17
    case = make_case(MIXED_RANKS, slots, H_IN, H_OUTS, 8, torch.float32)
    case.meta = dataclasses.replace(case.meta, grid_tokens_per_slot=1)

    def hook(op: str, problem: dict) -> dict:
        assert problem["max_tokens_per_slot"] == 1  # the grid's row count, not the 40 of slot 2
        return {"BLOCK_M": 16, **({"SPLIT_K": split_k} if op == "lora_shrink" else {})}

    out = _both_ops_exact_under(hook, case)
    assert out[:, 39].abs().sum() > 0  # the last row of the long segment was computed


def test_wrong_page_table_is_detected() -> None:
    """Sanity check that the comparison can fail: swapping two adapters' pages changes the result."""
    case = make_case(MIXED_RANKS, DECODE_SLOTS, H_IN, H_OUTS, 8, torch.float32)
    _, ref = _shrink_both(case)
    case.page_table[0, [2, 3]] = case.page_table[0, [3, 2]]
    bad, _ = _shrink_both(case)
    assert not torch.allclose(bad, ref, atol=1e-3)
