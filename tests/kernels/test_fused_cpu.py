"""The fused native CPU ops (kernels/fused_cpu.py) vs the unfused torch formulas of the model, at every
instruction-set level this CPU runs and in every dtype.

The oracle is the torch path of `engine/model/layers.py` and `decoder.py` (RMSNorm, SiLU * up) and
`engine/model/rope.py` (`apply_rope` with the llama3-scaled tables), itself checked against HF
transformers by the parity tests.
RoPE and the residual add must be bit-identical; RMSNorm may differ by the order of the sum of squares
(float32: a few ulp; a half-precision result rounded once, at most one ulp), SiLU by its exp.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rope
from kernels import fused_cpu
from kernels.fused_cpu import add_rms_norm, available_isas, rope_, silu_mul

ISAS = ["generic", "avx2", "avx512"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# |fused - torch| <= TOL * |torch| (+ a tiny absolute term): float32 a few ulp; one ulp of a half type.
TOL = {torch.float32: 4e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _isa(isa: str) -> str:
    if isa not in available_isas():
        pytest.skip(f"this CPU does not run the {isa} kernels (have {', '.join(available_isas())})")
    return isa


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, per_row: bool = False) -> None:
    """|got - want| <= TOL * |want| elementwise, or with `per_row` <= 2 TOL * max |want| over the last dim
    (RoPE sums two products: an input rounded one ulp apart moves an output near 0 by that ulp)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = 2 * want.float().abs().amax(-1, keepdim=True) if per_row else want.float().abs()
    err = (got.float() - want.float()).abs() - TOL[dtype] * scale
    assert err.max() <= 1e-30, f"max excess error {err.max():.3e}"


def _norm(cols: int, dtype: torch.dtype, seed: int = 5) -> RMSNorm:
    norm = RMSNorm(cols, 1e-5).to(dtype)
    norm.weight.data = _randn(cols, dtype=dtype, seed=seed)
    return norm


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [384, 389, 7])
def test_add_rms_norm_matches_the_torch_rmsnorm(isa, dtype, cols):
    norm = _norm(cols, dtype)
    res, delta = _randn(13, cols, dtype=dtype, seed=1, scale=3), _randn(13, cols, dtype=dtype, seed=2)
    want_res = res + delta
    got_res = res.clone()
    out = add_rms_norm(got_res, delta, norm.weight, norm.eps, isa=_isa(isa))
    assert torch.equal(got_res, want_res)  # the residual add: rounded as torch rounds it
    _close(out, norm(want_res), dtype)
    plain = res.clone()
    _close(add_rms_norm(plain, None, norm.weight, norm.eps, isa=isa), norm(res), dtype)  # no add
    assert torch.equal(plain, res)


def test_add_rms_norm_on_strided_rows():
    """Rows of a wider tensor (a packed projection's columns) are read and written in place."""
    norm = _norm(64, torch.float32)
    wide, delta = _randn(5, 100, dtype=torch.float32, seed=1), _randn(5, 64, dtype=torch.float32, seed=2)
    want = wide[:, 10:74] + delta
    out = add_rms_norm(wide[:, 10:74], delta, norm.weight, norm.eps)
    assert torch.equal(wide[:, 10:74], want)
    _close(out, norm(want), torch.float32)


def _qkv_case(dtype: torch.dtype, head_dim: int, tokens: int = 11):
    nh, nkv = 4, 2
    qkv = _randn(tokens, (nh + 2 * nkv) * head_dim, dtype=dtype, seed=3, scale=2)
    positions = torch.randint(0, 200, (tokens,), generator=torch.Generator().manual_seed(4))
    return qkv, positions, nh, nkv, RotaryEmbedding(head_dim, 200, 10000.0, LLAMA3)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 10])
def test_rope_in_place_is_bit_identical_to_apply_rope(isa, dtype, head_dim):
    qkv, positions, nh, nkv, rope = _qkv_case(dtype, head_dim)
    qk_cols = (nh + nkv) * head_dim
    want = apply_rope(qkv[:, :qk_cols].view(-1, nh + nkv, head_dim), rope.tables(positions))
    got = qkv.clone()
    rope_(got, nh + nkv, head_dim, positions, rope.cos, rope.sin, isa=_isa(isa))
    assert torch.equal(got[:, :qk_cols].view(-1, nh + nkv, head_dim), want)
    assert torch.equal(got[:, qk_cols:], qkv[:, qk_cols:])  # v untouched


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary"), [(64, 48), (16, 8), (10, 2)])
def test_partial_rotary_turns_only_the_leading_dims(isa, dtype, head_dim, rotary):
    """Tables for `rotary` < head_dim dims (Phi-4-mini: 96 of 128): the first `rotary` values of each
    head are rotated bit-identically to `apply_rope` of them, the rest stay; same through `FusedStep`."""
    qkv, positions, nh, nkv, _ = _qkv_case(dtype, head_dim)
    rope = RotaryEmbedding(head_dim, 200, 10000.0, None, rotary_dim=rotary)
    qk = qkv[:, : (nh + nkv) * head_dim].view(-1, nh + nkv, head_dim)
    want = torch.cat((apply_rope(qk[..., :rotary], rope.tables(positions)), qk[..., rotary:]), dim=-1)
    got, stepped = qkv.clone(), qkv.clone()
    rope_(got, nh + nkv, head_dim, positions, rope.cos, rope.sin, isa=_isa(isa))
    assert torch.equal(got[:, : (nh + nkv) * head_dim].view(-1, nh + nkv, head_dim), want)
    assert torch.equal(got[:, (nh + nkv) * head_dim :], qkv[:, (nh + nkv) * head_dim :])
    fused_cpu.FusedStep(dtype, positions, rope.cos, rope.sin).rope_(stepped, nh + nkv, None, head_dim)
    assert torch.equal(stepped, got)  # every ISA level gives the same bits


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 10])
def test_rope_with_qk_norm_matches_qwen3s_norm_then_rope(isa, dtype, head_dim):
    qkv, positions, nh, nkv, rope = _qkv_case(dtype, head_dim)
    q_norm, k_norm = _norm(head_dim, dtype, seed=6), _norm(head_dim, dtype, seed=7)
    tables = rope.tables(positions)
    t = qkv.shape[0]
    want_q = apply_rope(q_norm(qkv[:, : nh * head_dim].view(t, nh, head_dim)), tables)
    want_k = apply_rope(k_norm(qkv[:, nh * head_dim : (nh + nkv) * head_dim].view(t, nkv, head_dim)), tables)
    got = qkv.clone()
    qk_norm = (q_norm.weight, k_norm.weight, nh, q_norm.eps)
    rope_(got, nh + nkv, head_dim, positions, rope.cos, rope.sin, qk_norm, isa=_isa(isa))
    _close(got[:, : nh * head_dim].view(t, nh, head_dim), want_q, dtype, per_row=True)
    _close(got[:, nh * head_dim : (nh + nkv) * head_dim].view(t, nkv, head_dim), want_k, dtype, per_row=True)
    assert torch.equal(got[:, (nh + nkv) * head_dim :], qkv[:, (nh + nkv) * head_dim :])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1024, 1001, 5])
def test_silu_mul_matches_silu_times_up(isa, dtype, inter):
    gu = _randn(9, 2 * inter, dtype=dtype, seed=8, scale=6)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -89.0]).to(dtype)  # exp over/underflow, zero
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    _close(silu_mul(gu, isa=_isa(isa)), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_level_gives_the_same_bits(dtype):
    """16 partial sums at every vector width and no FMA contraction: the levels agree exactly."""
    res, delta = _randn(6, 389, dtype=dtype, seed=1), _randn(6, 389, dtype=dtype, seed=2)
    w = _randn(389, dtype=dtype, seed=3)
    gu = _randn(6, 2 * 1001, dtype=dtype, seed=4, scale=5)
    qkv, positions, nh, nkv, rope = _qkv_case(dtype, 10)
    qk_norm = (_randn(10, dtype=dtype, seed=5), _randn(10, dtype=dtype, seed=6), nh, 1e-6)
    results = []
    for isa in available_isas():
        rotated = qkv.clone()
        rope_(rotated, nh + nkv, 10, positions, rope.cos, rope.sin, qk_norm, isa=isa)
        results.append((add_rms_norm(res.clone(), delta, w, 1e-6, isa=isa), silu_mul(gu, isa=isa), rotated))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_results_do_not_depend_on_the_thread_count():
    """Calls above the grain (rows * cols > 32768) split rows between threads; rows are independent."""
    res, delta = _randn(300, 389, dtype=torch.float32, seed=1), _randn(300, 389, dtype=torch.float32, seed=2)
    w = _randn(389, dtype=torch.float32, seed=3)
    gu = _randn(300, 2 * 301, dtype=torch.bfloat16, seed=4)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((add_rms_norm(res.clone(), delta, w, 1e-6), silu_mul(gu)))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_prepared_step_computes_what_the_checked_ops_do(dtype):
    """`FusedStep` (the engine's per-forward entry, checked once) gives the same bits as the functions."""
    qkv, positions, nh, nkv, rope = _qkv_case(dtype, 64)
    step = fused_cpu.FusedStep(dtype, positions, rope.cos, rope.sin)
    qk_norm = (_randn(64, dtype=dtype, seed=5), _randn(64, dtype=dtype, seed=6), nh, 1e-6)
    want, got = qkv.clone(), qkv.clone()
    rope_(want, nh + nkv, 64, positions, rope.cos, rope.sin, qk_norm)
    step.rope_(got, nh + nkv, qk_norm)
    assert torch.equal(got, want)
    res, delta = _randn(11, 389, dtype=dtype, seed=1), _randn(11, 389, dtype=dtype, seed=2)
    w = _randn(389, dtype=dtype, seed=3)
    r1, r2 = res.clone(), res.clone()
    assert torch.equal(step.add_rms_norm(r1, delta, w, 1e-6), add_rms_norm(r2, delta, w, 1e-6))
    assert torch.equal(r1, r2)
    assert torch.equal(step.silu_mul(qkv[:, :256]), silu_mul(qkv[:, :256]))
    with pytest.raises(ValueError, match="outside the tables"):
        fused_cpu.FusedStep(dtype, positions + 200, rope.cos, rope.sin).rope_(qkv.clone(), nh + nkv)


def test_bad_inputs_get_clear_errors():
    x = torch.zeros(4, 16)
    rope = RotaryEmbedding(8, 10, 10000.0, None)
    with pytest.raises(ValueError, match="outside the tables"):
        rope_(x, 2, 8, torch.tensor([0, 1, 10, 2]), rope.cos, rope.sin)
    with pytest.raises(ValueError, match="do not fit"):
        rope_(x, 3, 8, torch.zeros(4, dtype=torch.int64), rope.cos, rope.sin)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="unit column stride"):
        silu_mul(x.t())
    with pytest.raises(ValueError, match="odd width"):
        silu_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="not available"):
        silu_mul(x, isa="no-such-isa")
    assert set(fused_cpu.supported_dtypes()) >= {torch.float32, torch.bfloat16}
