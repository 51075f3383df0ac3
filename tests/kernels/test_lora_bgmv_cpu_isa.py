"""The native CPU BGMV kernel with half-precision activations, at every instruction-set level this CPU runs,
vs the torch reference (which does the math in float32 and rounds y once)."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_bgmv_cpu import PreparedBGMV, available_isas, best_isa, lora_bgmv_cpu, supported_dtypes
from kernels.reference import lora_expand_ref, lora_shrink_ref
from tests.kernels.lora_case import make_case
from tests.kernels.test_lora_bgmv_cpu import PREFILL_RUNS, _pairs
from tests.kernels.test_lora_ops import DECODE_SLOTS, MIXED_RANKS

ISAS = ["generic", "avx2", "avx512bf16"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Per activation dtype: |kernel - reference| <= TOL * (1 + |reference|). A half-precision y row is
# rounded once per row, like the reference, so the two are at most one ulp apart (float32 sums in another
# order may round the other way). One ulp of v is at most 2**(1 - p) * |v| for p significand bits
# (bfloat16: 8, float16: 11), hence TOL = 2**(1 - p).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _isa(isa: str) -> str:
    if isa not in available_isas():
        pytest.skip(f"this CPU does not run the {isa} kernel (have {', '.join(available_isas())})")
    return isa


def _check_case(case, h_outs, page_rank, x_dtype, isa, runs, seed=3):
    x = case.x.to(x_dtype)
    y0 = torch.randn(x.shape[0], sum(h_outs), generator=torch.Generator().manual_seed(seed)).to(x_dtype)
    y = y0.clone()
    off = 0
    for s, width in enumerate(h_outs):
        a, b = case.a_pools[s].contiguous(), case.b_pools[s].contiguous()
        lora_bgmv_cpu(x, y[:, off : off + width], a, b, *_pairs(case, s, page_rank, runs), isa=isa)
        off += width
    v = torch.empty(len(h_outs), x.shape[0], case.max_rank)
    lora_shrink_ref(x, case.a_pools, case.page_table, case.ranks, case.meta, v)
    ref = y0.clone()
    lora_expand_ref(v, case.b_pools, case.page_table, case.ranks, case.scalings, case.meta, ref)
    err = (y.float() - ref.float()).abs() / (1 + ref.float().abs())
    assert err.max() <= TOL[x_dtype], f"max relative error {err.max():.2e}"
    assert not torch.isnan(y).any()
    no_adapter = [t for t, slot in enumerate(case.meta.token_slots.tolist()) if slot < 0]
    assert torch.equal(y[no_adapter], y0[no_adapter])  # rows without adapter: not even re-rounded
    assert not torch.equal(y, y0)
    return y


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", DTYPES, ids=lambda d: f"pages-{str(d)[6:]}")
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: f"x-{str(d)[6:]}")
@pytest.mark.parametrize("runs", [False, True], ids=["rows", "runs"])
def test_every_dtype_pair_and_isa_matches_reference(x_dtype, w_dtype, isa, runs):
    """Mixed ranks (multi-page adapters, partial pages), decode rows and prefill runs, odd feature sizes
    (the vector loops' tails: 40 input features = 32 + 8)."""
    isa = _isa(isa)
    if w_dtype not in supported_dtypes(x_dtype):
        pytest.skip(f"the C compiler here has no kernel for {x_dtype} x {w_dtype}")
    case = make_case(MIXED_RANKS, DECODE_SLOTS * 2 + PREFILL_RUNS, 40, [40, 24, 13], 8, w_dtype)
    _check_case(case, [40, 24, 13], 8, x_dtype, isa, runs)


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_wide_features(isa):
    """bfloat16 x bfloat16 with several 32-element blocks and a tail (the AVX-512 BF16 dot-product path's
    full and masked loads), four-row and two-row shrinks."""
    isa = _isa(isa)
    case = make_case([[16, 32, 5, 64]], [0, 1, 2, -1, 1, 3, 3, 3, 3, 3], 101, [96], 16, torch.bfloat16)
    for runs in (False, True):
        _check_case(case, [96], 16, torch.bfloat16, isa, runs)


def test_isas_agree_and_the_best_is_the_default():
    """Every level computes the same thing (float32 sums in another order); no isa= means the best."""
    case = make_case(MIXED_RANKS[:1], DECODE_SLOTS + PREFILL_RUNS, 40, [40], 8, torch.bfloat16)
    outs = {isa: _check_case(case, [40], 8, torch.bfloat16, isa, True) for isa in available_isas()}
    default = _check_case(case, [40], 8, torch.bfloat16, None, True)
    assert torch.equal(default, outs[best_isa()])
    for y in outs.values():
        diff = (y.float() - default.float()).abs() / (1 + default.float().abs())
        assert diff.max() <= TOL[torch.bfloat16]


def test_prepared_call_with_bfloat16_activations_writes_its_columns():
    """`PreparedBGMV(activations=bfloat16)`: the column offset is in elements of y's dtype."""
    case = make_case(MIXED_RANKS[:2], DECODE_SLOTS, 40, [40, 24], 8, torch.bfloat16)
    x = case.x.bfloat16()
    y0 = torch.randn(x.shape[0], 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    a, b = case.a_pools[1].contiguous(), case.b_pools[1].contiguous()
    expected = y0.clone()
    lora_bgmv_cpu(x, expected[:, 40:], a, b, *_pairs(case, 1, 8))
    rows, ranks, starts, counts, scale = _pairs(case, 1, 8)
    prepared = PreparedBGMV(
        a, b, rows[None], ranks[None], starts, counts, scale[None], activations=torch.bfloat16
    )
    y = y0.clone()
    prepared(0, x, y, 40)
    assert torch.equal(y, expected) and torch.equal(y[:, :40], y0[:, :40]) and not torch.equal(y, y0)


def test_mismatched_activation_dtypes_are_refused():
    case = make_case([[16]], [0], 32, [16], 16, torch.bfloat16)
    a, b = case.a_pools[0].contiguous(), case.b_pools[0].contiguous()
    with pytest.raises(ValueError, match="y has dtype"):
        lora_bgmv_cpu(case.x.bfloat16(), torch.zeros(1, 16), a, b, *_pairs(case, 0, 16))
    with pytest.raises(ValueError, match="not available here"):
        lora_bgmv_cpu(case.x.float(), torch.zeros(1, 16), a, b, *_pairs(case, 0, 16), isa="sse9")
