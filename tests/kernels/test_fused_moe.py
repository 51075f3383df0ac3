"""Triton fused MoE (interpreted) vs the torch reference, the reference vs a dense oracle, and the routing
alignment it reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.fused_moe import _fused_moe_kernel, fused_moe
from kernels.moe_align import align_pairs, max_padded_pairs
from kernels.reference import fused_moe_ref
from kernels.tuning import set_config_hook

REPO = Path(__file__).resolve().parents[2]
H, INTER = 48, 40  # neither a power of two: exercises N and K masking
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


def _case(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, used: int | None = None, seed=0):
    """x, w_gate_up, w_down, topk_weights, topk_ids; with `used`, tokens route only to experts 0..used-1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * INTER, H, generator=gen) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, H, INTER, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if used is not None:
        logits[:, used:] = float("-inf")
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w_gate_up, w_down, weights.to(dtype), ids


def _dense_oracle(x, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    """Every expert on every token, masked by the routing: no sorting, no gathering."""
    gu = torch.einsum("th,eih->tei", x.double(), w_gate_up.double())
    h = torch.nn.functional.silu(gu[..., :INTER]) * gu[..., INTER:]
    y = torch.einsum("tei,ehi->teh", h, w_down.double())
    gate = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=torch.float64)
    gate.scatter_add_(1, ids, weights.double())
    return torch.einsum("te,teh->th", gate, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "used"),
    [(1, 8, 2, None), (3, 16, 4, None), (5, 8, 1, None), (70, 8, 2, None), (67, 16, 4, 6), (40, 32, 1, None)],
    ids=["decode-1", "decode-3-top4", "decode-5-top1", "prefill-70-top2", "prefill-67-top4-10-idle",
         "prefill-40-top1-32e"],
)  # fmt: skip
def test_matches_reference(num_tokens, num_experts, top_k, used, dtype) -> None:
    case = _case(num_tokens, num_experts, top_k, dtype, used)
    out = fused_moe(*case)
    ref = fused_moe_ref(*case)
    assert out.shape == (num_tokens, H) and out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    assert ref.abs().max() > 0.5


def test_reference_matches_dense_oracle() -> None:
    case = _case(37, 8, 3, torch.float32, used=5)
    torch.testing.assert_close(fused_moe_ref(*case).double(), _dense_oracle(*case), rtol=1e-5, atol=1e-5)


def test_unrouted_experts_are_never_read() -> None:
    """Experts no token chose hold NaN: the output stays finite (their weights are never loaded)."""
    x, w_gate_up, w_down, weights, ids = _case(9, 16, 2, torch.float32, used=4)
    w_gate_up[4:], w_down[4:] = float("nan"), float("nan")
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [{"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32}],
    ids=["m32-small-tiles", "m64"],
)
def test_tuned_blocks_through_the_hook(config) -> None:
    """Several N blocks and K steps per program, wider row blocks (more padding per expert)."""
    seen = []

    def hook(op, problem):
        seen.append((op, dict(problem)))
        return config

    previous = set_config_hook(hook)
    try:
        case = _case(45, 8, 2, torch.float32)
        out = fused_moe(*case)
    finally:
        set_config_hook(previous)
    assert seen == [("fused_moe", {"num_pairs": 90, "num_experts": 8, "hidden": H, "inter": INTER})]
    torch.testing.assert_close(out, fused_moe_ref(*case), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_int32_ids() -> None:
    x, w_gate_up, w_down, weights, ids = _case(11, 8, 2, torch.float32)
    wide = torch.zeros(11, 2 * H)
    wide[:, 5 : 5 + H] = x
    out = fused_moe(wide[:, 5 : 5 + H], w_gate_up, w_down, weights, ids.to(torch.int32))
    torch.testing.assert_close(out, fused_moe_ref(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-5)


def test_empty_batch() -> None:
    x, w_gate_up, w_down, weights, ids = _case(0, 8, 2, torch.float32)
    assert fused_moe(x, w_gate_up, w_down, weights, ids).shape == (0, H)


def test_alignment_groups_pairs_by_expert_in_padded_runs() -> None:
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 1], [3, 0]])
    al = align_pairs(ids, num_experts=8, block_m=4)
    assert al.sorted_pair_ids.shape[0] == max_padded_pairs(10, 8, 4) == 36  # 10 + 8 runs * 3
    assert int(al.num_padded) == 16  # experts 0, 1, 3, 5: runs of 3, 1, 4, 2 padded to 4 each
    sentinel = 10
    want = [1, 4, 9, sentinel, 7, sentinel, sentinel, sentinel, 0, 2, 5, 8, 3, 6, sentinel, sentinel]
    assert al.sorted_pair_ids[:16].tolist() == want
    assert al.sorted_pair_ids[16:].tolist() == [sentinel] * 20
    assert al.block_experts.tolist() == [0, 1, 3, 5] + [8] * 5  # experts 2, 4, 6, 7 get no block


def test_alignment_refuses_bad_ids() -> None:
    with pytest.raises(ValueError, match="2-D int32/int64"):
        align_pairs(torch.tensor([1.0, 2.0]), 4, 16)


def test_bad_inputs_are_named() -> None:
    x, w_gate_up, w_down, weights, ids = _case(4, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="w_down has shape"):
        fused_moe(x, w_gate_up, w_down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="w_gate_up has dtype"):
        fused_moe(x, w_gate_up.half(), w_down, weights, ids)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        fused_moe(x, w_gate_up, w_down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="topk_ids has shape"):
        fused_moe(x[:3], w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\)"):
        fused_moe(x, w_gate_up, w_down, weights, ids + 7)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        fused_moe(x, w_gate_up[:, :-1], w_down, weights, ids)


def test_kernel_is_interpreted_and_compiles_as_a_custom_op() -> None:
    from kernels._common import is_interpreted

    assert is_interpreted(_fused_moe_kernel)
    assert hasattr(torch.ops.loraplex, "fused_moe_pass")
    case = _case(6, 8, 2, torch.float32)
    compiled = torch.compile(fused_moe, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*case), fused_moe(*case))


def test_kernel_compiles_for_cuda_sm90() -> None:
    """The real Triton compiler (not the interpreter) accepts the kernel in both passes, with and without
    expert LoRA, and the expert-LoRA shrink; needs no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.fused_moe_compile_check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok fused_moe ") == 16 and proc.stdout.count("ok fused_moe_lora_shrink ") == 4
