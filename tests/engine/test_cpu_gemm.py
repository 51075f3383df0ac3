"""Projections and LM head through prepacked oneDNN weights (engine/model/cpu_gemm.py) on the CPU in
float32 (and in bfloat16 where the CPU computes it natively): the same products as `F.linear`, used by
the engine by default, and greedy tokens equal to the dense weights' and to HF transformers' for every
family (tied and untied heads, q/k/v bias)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.cpu_gemm import can_pack, pack, packed_linear
from engine.model.linear import ProjectionLinear
from tests.helpers.tiny_models import ARCHS

PROMPTS = [[5, 9, 14, 3, 77], [8] * 3, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


@pytest.mark.parametrize("rows", [1, 7, 13, 32, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 72, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 150, generator=gen)[:, 10:82]  # strided rows, as a packed projection's slice
    want = torch.nn.functional.linear(x, w, b)
    got = packed_linear(x, pack(w), b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(packed_linear(x, pack(w * 1.01), b), want, rtol=1e-5, atol=1e-4)


NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_what_is_packed():
    """CPU float32 always; bfloat16 exactly where oneDNN computes it natively; never float16 or CUDA."""
    cpu = torch.device("cpu")
    assert can_pack(cpu, torch.float32)
    assert can_pack(cpu, torch.bfloat16) == NATIVE_BF16
    assert not can_pack(cpu, torch.float16) and not can_pack(torch.device("cuda"), torch.float32)


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bfloat16 (AVX-512 BF16 / AMX)")
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_packed_linear_bfloat16_equals_f_linear(rows):
    """In bfloat16 `F.linear` runs the same oneDNN kernel on the dense weight: the packed form gives the
    same bits (a weight that differs in one bfloat16 ulp does not)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 72, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 150, generator=gen)[:, 10:82].bfloat16()
    want = torch.nn.functional.linear(x, w, b)
    got = packed_linear(x, pack(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(packed_linear(x, pack(w * 1.01), b), want)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_packs_by_default_and_keeps_greedy_tokens(arch, checkpoint, oracle):
    base = checkpoint(arch)
    packed = LLM(str(base), device="cpu", dtype="float32")
    model = packed.engine.model
    projections = [m for m in model.modules() if isinstance(m, ProjectionLinear)]
    assert projections and all(m.packed and m.weight.is_mkldnn for m in projections)
    assert model.packed_head is not None
    dense = LLM(str(base), device="cpu", dtype="float32", packed_cpu_gemms=False)
    assert not any(m.packed for m in dense.engine.model.modules() if isinstance(m, ProjectionLinear))
    tokens = _greedy(packed)
    assert tokens == _greedy(dense)
    assert tokens == [oracle(base).greedy(p, 8) for p in PROMPTS]


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bfloat16 (AVX-512 BF16 / AMX)")
def test_engine_packs_bfloat16_and_keeps_its_tokens(checkpoint):
    """A bfloat16 engine packs its weights where the CPU computes bfloat16 natively, and its greedy
    tokens are those of the dense bfloat16 weights (the same oneDNN kernels, so the same bits)."""
    base = checkpoint("llama")
    packed = LLM(str(base), device="cpu", dtype="bfloat16")
    model = packed.engine.model
    assert all(m.packed for m in model.modules() if isinstance(m, ProjectionLinear))
    assert model.packed_head is not None
    dense = LLM(str(base), device="cpu", dtype="bfloat16", packed_cpu_gemms=False)
    assert dense.engine.model.packed_head is None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in packed.generate(PROMPTS, params)]
    assert got == [o.outputs[0].token_ids for o in dense.generate(PROMPTS, params)]
