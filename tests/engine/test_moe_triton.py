"""The MoE layer's CUDA path (the Triton fused-MoE kernel, `SparseMoE.triton_experts`) run on CPU through
Triton's interpreter: equal to the torch path layer by layer, and the engine's greedy tokens with it equal
transformers' for every MoE family."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.moe import SparseMoE
from engine.model_config import ModelConfig
from kernels.reference import fused_moe_ref
from tests.helpers.hf_greedy import check_greedy, fp32_cpu_llm, random_prompts
from tests.helpers.tiny_models import MOE_ARCHS

pytestmark = pytest.mark.slow  # Triton kernels interpreted on CPU through the engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_triton_experts_equal_the_torch_loop(arch, dtype, checkpoint):
    """Every MoE layer of the loaded model: decode-sized and prefill-sized batches."""
    model = load_model(ModelConfig.from_dir(checkpoint(arch)), dtype, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert layers
    gen = torch.Generator().manual_seed(3)
    for moe in layers:
        for tokens in (1, 4, 37):
            x = torch.randn(tokens, moe.gate.weight.shape[1], generator=gen).to(dtype)
            weights, ids = moe.route(x)
            got = moe.triton_experts(x, weights, ids).float()
            want = moe.torch_experts(x, weights, ids).float()
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                continue
            # bf16: the loop rounds after every op (its pairs' outputs too, before they are summed), the
            # kernel only h and the output: against float32 math on the same weights it stays within
            # two bf16 ulps, the loop within a wider bound
            w = (moe.experts.gate_up.float(), moe.experts.down.float())
            exact = fused_moe_ref(x.float(), *w, weights.float(), ids)
            torch.testing.assert_close(got, exact, rtol=1.6e-2, atol=2e-2)
            torch.testing.assert_close(want, exact, rtol=1.6e-2, atol=1e-1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_on_the_triton_path_matches_hf(arch, checkpoint, oracle, monkeypatch):
    """The CPU engine with the MoE layers' routed experts on the kernel (the dispatch picks it for CUDA
    tensors; here the torch loop is swapped out) gives transformers' tokens, with chunked prefill."""
    calls = []

    def triton_only(self, x, weights, ids):
        calls.append(x.shape[0])
        return SparseMoE.triton_experts(self, x, weights, ids)

    monkeypatch.setattr(SparseMoE, "torch_experts", triton_only)
    ckpt = checkpoint(arch)
    check_greedy(fp32_cpu_llm(ckpt, max_num_batched_tokens=16), oracle(ckpt), random_prompts(5, [3, 21, 9]))
    assert calls and max(calls) > 1 and min(calls) >= 1
