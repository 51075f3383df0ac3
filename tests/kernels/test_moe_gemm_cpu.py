"""The native small-GEMM kernel of the CPU MoE path (`kernels/moe_gemm_cpu.py`) at every instruction-set
level this CPU runs, against per-expert `F.linear` (float32 math): row counts 1..4 and beyond (the
kernel's row groups), odd sizes (its column and lane remainders), experts skipped above `max_rows`; and
the MoE layer's CPU path with it against the layer without it."""

from __future__ import annotations

import pytest
import torch

import engine.model.moe_experts as moe_experts
from kernels.moe_gemm_cpu import available_isas, grouped_small_gemm

COUNTS = [0, 1, 2, 3, 4, 5, 9, 0, 7, 17]


def _case(dtype, out_f=37, in_f=45, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    xs = torch.randn(int(counts.sum()), in_f, generator=gen).to(dtype)
    w = torch.randn(len(COUNTS), out_f, in_f, generator=gen).to(dtype)
    return xs, w, counts


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_f", "in_f"), [(37, 45), (64, 128), (3, 5)])
def test_matches_linear_per_expert(isa, dtype, out_f, in_f) -> None:
    xs, w, counts = _case(dtype, out_f, in_f)
    ys = torch.full((xs.shape[0], out_f), float("nan"), dtype=dtype)
    grouped_small_gemm(xs, w, counts, 9, ys, isa=isa)
    start = 0
    for e, n in enumerate(COUNTS):
        got = ys[start : start + n]
        if n > 9:
            assert got.isnan().all()  # skipped: left to the caller
        elif n:
            want = (xs[start : start + n].float() @ w[e].float().T).to(dtype)
            rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 1e-2)
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
        start += n


def test_strided_rows_and_threads() -> None:
    """Rows of xs and ys a wider stride apart; 1 and 2 threads give the same bits."""
    xs, w, counts = _case(torch.float32)
    wide = torch.zeros(xs.shape[0], 64)
    wide[:, :45] = xs
    outs = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ys = torch.zeros(xs.shape[0], 50)[:, :37]
            grouped_small_gemm(wide[:, :45], w, counts, 64, ys)
        finally:
            torch.set_num_threads(prev)
        outs.append(ys.clone())
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0][:1], xs[:1] @ w[1].T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused() -> None:
    xs, w, counts = _case(torch.float32)
    ys = torch.empty(xs.shape[0], 37)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_small_gemm(xs.double(), w, counts, 4, ys)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_small_gemm(xs[:, :40], w, counts, 4, ys)
    with pytest.raises(ValueError, match="counts cover"):
        grouped_small_gemm(xs[:10], w, counts, 4, ys[:10])
    with pytest.raises(ValueError, match="contiguous int64"):
        grouped_small_gemm(xs, w, counts.int(), 4, ys)
    with pytest.raises(ValueError, match="instruction set 'sve'"):
        grouped_small_gemm(xs, w, counts, 4, ys, isa="sve")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 6, 130, 400])
def test_experts_forward_with_and_without_the_kernel(dtype, tokens, monkeypatch) -> None:
    """`experts_forward` on decode-sized steps (every expert <= NATIVE_MAX_ROWS rows: the kernel), a step
    with experts on both sides of the bound (the kernel for the small ones, a GEMM each for the others)
    and a prefill-sized one (every expert past it: torch's grouped GEMM) equals the layer on torch's
    GEMMs alone."""
    gen = torch.Generator().manual_seed(tokens)
    num_experts, hidden, inter, top_k = 8, 48, 40, 2
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(tokens, num_experts, generator=gen).softmax(-1), top_k, dim=-1)
    weights = weights.to(dtype)
    assert moe_experts._native_works("cpu", dtype)  # checked once (one call of its own), before counting
    calls: list[int] = []
    real = grouped_small_gemm

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr("kernels.moe_gemm_cpu.grouped_small_gemm", counted)
    got = moe_experts.experts_forward(gate_up, down, x, weights, ids)
    monkeypatch.setattr(moe_experts, "_native_works", lambda device, dtype: False)
    want = moe_experts.experts_forward(gate_up, down, x, weights, ids)
    rows = torch.bincount(ids.reshape(-1), minlength=num_experts)
    some_small = int(rows[rows > 0].min()) <= moe_experts.NATIVE_MAX_ROWS
    some_large = int(rows.max()) > moe_experts.NATIVE_MAX_ROWS
    assert (some_small, some_large) == {1: (True, False), 6: (True, False), 130: (True, True)}.get(
        tokens, (False, True)
    )
    assert len(calls) == (2 if some_small else 0)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
