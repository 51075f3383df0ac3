"""The native CPU BGMV kernel (compiled C) vs the torch reference (shrink, scaling, expand)."""

from __future__ import annotations

import pytest
import torch

from kernels.intmath import cdiv
from kernels.lora_bgmv_cpu import PreparedBGMV, lora_bgmv_cpu, supported_dtypes
from kernels.reference import lora_expand_ref, lora_shrink_ref
from tests.kernels.lora_case import LoRACase, make_case
from tests.kernels.test_lora_ops import DECODE_SLOTS, H_IN, H_OUTS, MIXED_RANKS, PREFILL_SLOTS

SLICE_OFFSETS = [sum(H_OUTS[:s]) for s in range(len(H_OUTS))]


def _pairs(case: LoRACase, s: int, page_rank: int, runs: bool = False) -> tuple[torch.Tensor, ...]:
    """(page_rows, page_ranks, row_starts, row_counts, scale) of slice s, for every (run, page) pair.

    Runs are single tokens, or with `runs` the longest stretches of consecutive tokens on one slot."""
    spans: list[tuple[int, int, int]] = []  # (start, count, slot)
    for t, slot in enumerate(case.meta.token_slots.tolist()):
        if runs and spans and spans[-1][2] == slot and spans[-1][0] + spans[-1][1] == t:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1, slot)
        else:
            spans.append((t, 1, slot))
    pages, ranks, starts, counts, scale = [], [], [], [], []
    for start, count, slot in spans:
        r = int(case.ranks[s, slot]) if slot >= 0 else 0
        for j in range(cdiv(r, page_rank)):
            pages.append(int(case.page_table[s, slot, j]))
            ranks.append(min(page_rank, r - j * page_rank))
            starts.append(start)
            counts.append(count)
            scale.append(float(case.scalings[s, slot]))
    return (
        torch.tensor(pages, dtype=torch.int64),
        torch.tensor(ranks, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int32),
        torch.tensor(scale, dtype=torch.float32),
    )


def _run_both(
    case: LoRACase, page_rank: int, num_threads: int = 1, runs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """y0 + LoRA by the native kernel (slice by slice) and by the reference, both float32."""
    x = case.x.float()
    y0 = torch.randn(x.shape[0], sum(H_OUTS), generator=torch.Generator().manual_seed(3))
    y = y0.clone()
    for s in range(len(H_OUTS)):
        a = case.a_pools[s].contiguous()  # the pages of one layer; NaN beyond each adapter's rank
        b = case.b_pools[s].contiguous()
        cols = y[:, SLICE_OFFSETS[s] : SLICE_OFFSETS[s] + H_OUTS[s]]  # strided rows, like a packed output
        lora_bgmv_cpu(x, cols, a, b, *_pairs(case, s, page_rank, runs), num_threads=num_threads)
    v = torch.empty(len(H_OUTS), x.shape[0], case.max_rank)
    lora_shrink_ref(x, case.a_pools, case.page_table, case.ranks, case.meta, v)
    ref = y0.clone()
    lora_expand_ref(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, ref)
    return y, ref


PREFILL_RUNS = [3] * 7 + [-1] * 2 + [5] * 9 + [0] * 4 + [1]  # prefill chunks: runs of 7, 9, 4 and 1 rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("token_slots", "page_rank", "runs"),
    [
        (DECODE_SLOTS, 16, False),
        (DECODE_SLOTS, 8, False),
        (PREFILL_SLOTS, 8, False),
        (PREFILL_SLOTS, 8, True),
        (PREFILL_RUNS, 16, True),
        ([2], 24, False),
    ],
    ids=["decode-16", "decode-8", "rows-8", "runs-8", "prefill-runs-16", "one-24"],
)
def test_matches_reference(token_slots: list[int], page_rank: int, runs: bool, dtype: torch.dtype) -> None:
    """Mixed ranks 1..128 (partial last pages, multi-page adapters), rows without adapter, half weights,
    pairs of one row and pairs of whole runs."""
    if dtype not in supported_dtypes():
        pytest.skip(f"the C compiler here has no {dtype}")
    case = make_case(MIXED_RANKS, token_slots, H_IN, H_OUTS, page_rank, dtype)
    y, ref = _run_both(case, page_rank, runs=runs)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)  # float32 math on the same weights
    assert not torch.isnan(y).any()  # NaN rows of pages beyond each rank, and NaN x rows, never read


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("runs", [False, True], ids=["rows", "runs"])
def test_odd_sizes_take_the_scalar_tails(dtype: torch.dtype, runs: bool) -> None:
    """In/out features and ranks that are not multiples of 8 (the vector loops' scalar remainders)."""
    if dtype not in supported_dtypes():
        pytest.skip(f"the C compiler here has no {dtype}")
    h_outs = [13, 9]
    case = make_case([[5, 16, 11], [3, 0, 20]], [0, 0, 0, 1, -1, 2, 2], 37, h_outs, 8, dtype)
    x = case.x.float()
    y0 = torch.randn(x.shape[0], sum(h_outs), generator=torch.Generator().manual_seed(5))
    y = y0.clone()
    for s, off in ((0, 0), (1, h_outs[0])):
        a, b = case.a_pools[s].contiguous(), case.b_pools[s].contiguous()
        lora_bgmv_cpu(x, y[:, off : off + h_outs[s]], a, b, *_pairs(case, s, 8, runs))
    v = torch.empty(2, x.shape[0], case.max_rank)
    lora_shrink_ref(x, case.a_pools, case.page_table, case.ranks, case.meta, v)
    ref = y0.clone()
    lora_expand_ref(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, ref)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[4], y0[4])


def test_wide_features_use_vector_paths() -> None:
    """Feature sizes that are multiples of 8 (the vectorized shrink and eight-outputs-at-once expand)."""
    case = make_case([[16, 32, 8]], [0, 1, 2, -1, 1], 64, [96], 16, torch.float32)
    x = case.x.float()
    y = torch.zeros(x.shape[0], 96)
    lora_bgmv_cpu(x, y, case.a_pools[0].contiguous(), case.b_pools[0].contiguous(), *_pairs(case, 0, 16))
    v = torch.empty(1, x.shape[0], case.max_rank)
    lora_shrink_ref(x, case.a_pools, case.page_table, case.ranks, case.meta, v)
    ref = torch.zeros_like(y)
    lora_expand_ref(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, ref)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert y[3].abs().sum() == 0 and y.abs().sum() > 0


@pytest.mark.parametrize("runs", [False, True], ids=["rows", "runs"])
def test_threads_agree_bit_for_bit(runs: bool) -> None:
    """Two or three OpenMP threads give the same bits as one: each row's pages are added by one thread,
    in order (short runs are split between threads whole, long runs by rows)."""
    case = make_case(MIXED_RANKS, DECODE_SLOTS * 4 + PREFILL_RUNS, H_IN, H_OUTS, 8, torch.float32)
    one, ref = _run_both(case, 8, num_threads=1, runs=runs)
    for threads in (2, 3):
        many, _ = _run_both(case, 8, num_threads=threads, runs=runs)
        assert torch.equal(one, many)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused() -> None:
    case = make_case([[16]], [0], 32, [16], 16, torch.float32)
    a, b = case.a_pools[0].contiguous(), case.b_pools[0].contiguous()
    pairs = _pairs(case, 0, 16)
    x = case.x.float()
    with pytest.raises(ValueError, match="x has dtype"):
        lora_bgmv_cpu(x.double(), torch.zeros(1, 16), a, b, *pairs)
    with pytest.raises(ValueError, match="shapes do not agree"):
        lora_bgmv_cpu(x, torch.zeros(1, 17), a, b, *pairs)
    with pytest.raises(ValueError, match="must be contiguous"):
        lora_bgmv_cpu(x, torch.zeros(1, 16), case.a_pools[0], b, *pairs)
    with pytest.raises(ValueError, match="row_starts has 2 entries"):
        lora_bgmv_cpu(x, torch.zeros(1, 16), a, b, pairs[0], pairs[1], pairs[2].repeat(2), *pairs[3:])


def test_prepared_call_matches_and_writes_only_its_columns() -> None:
    """`PreparedBGMV` (pointers fixed once, as the engine uses it) == the checked call, at a column offset."""
    case = make_case(MIXED_RANKS, DECODE_SLOTS, H_IN, H_OUTS, 8, torch.float32)
    x = case.x.float()
    y0 = torch.randn(x.shape[0], sum(H_OUTS), generator=torch.Generator().manual_seed(4))
    s, col = 1, SLICE_OFFSETS[1]
    a, b = case.a_pools[s].contiguous(), case.b_pools[s].contiguous()
    expected = y0.clone()
    lora_bgmv_cpu(x, expected[:, col : col + H_OUTS[s]], a, b, *_pairs(case, s, 8))
    y = y0.clone()
    rows, ranks, starts, counts, scale = _pairs(case, s, 8)
    prepared = PreparedBGMV(a, b, rows[None], ranks[None], starts, counts, scale[None])  # one layer
    prepared(0, x, y, col)
    assert torch.equal(y, expected)
    outside = torch.ones(y.shape[1], dtype=torch.bool)
    outside[col : col + H_OUTS[s]] = False
    assert torch.equal(y[:, outside], y0[:, outside]) and not torch.equal(y, y0)
