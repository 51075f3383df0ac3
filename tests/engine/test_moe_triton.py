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


def _on_triton(monkeypatch, calls: list[int]) -> None:
    """Route every MoE block's experts to the kernel (the dispatch picks it for CUDA tensors only),
    noting each call's row count in `calls`."""
    triton_experts = SparseMoE.triton_experts

    def counted(self, x, weights, ids, hook=None):
        calls.append(x.shape[0])
        return triton_experts(self, x, weights, ids, hook)

    monkeypatch.setattr(SparseMoE, "uses_triton", lambda self, x: True)
    monkeypatch.setattr(SparseMoE, "triton_experts", counted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_triton_blocks_equal_the_cpu_path(arch, dtype, checkpoint, monkeypatch):
    """Every MoE block of the loaded model (Qwen2-MoE's with its shared expert), decode-sized and
    prefill-sized batches: the kernel's output equals the CPU path's. The CPU path here is the op-by-op
    one, which routes with `SparseMoE.route` as the kernel's caller does: the CPU's fused decode call
    breaks exact ties of bfloat16 router logits toward the lower expert id, and torch.topk's order among
    ties is unspecified, so on a tie the two would route a token to different experts."""
    import engine.model.moe_experts as moe_experts

    monkeypatch.setattr(moe_experts, "FUSED_DECODE", False)
    model = load_model(ModelConfig.from_dir(checkpoint(arch)), dtype, torch.device("cpu"))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(n, blocks[0].gate.weight.shape[1], generator=gen).to(dtype) for n in (1, 4, 37)]
    with torch.no_grad():
        want = [[b(x).float() for x in inputs] for b in blocks]
        calls: list[int] = []
        _on_triton(monkeypatch, calls)
        got = [[b(x).float() for x in inputs] for b in blocks]
    assert calls == [1, 4, 37] * len(blocks)
    for block, outs, refs in zip(blocks, got, want, strict=True):
        for x, out, ref in zip(inputs, outs, refs, strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                continue
            # bf16: the CPU path rounds after every op (its pairs' outputs too, before they are summed),
            # the kernel only h and the output: against float32 math on the same weights its routed
            # experts stay within one bf16 ulp of the largest terms summed (~8 here: atol); the two blocks'
            # outputs within a wider bound
            weights, ids = block.route(x)
            w = (block.experts.gate_up.float(), block.experts.down.float())
            routed = fused_moe_ref(x.float(), *w, weights.float(), ids)
            kernel = block.triton_experts(x, weights, ids).float()
            torch.testing.assert_close(kernel, routed, rtol=1.6e-2, atol=6e-2)
            torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_on_the_triton_path_matches_hf(arch, checkpoint, oracle, monkeypatch):
    """The CPU engine with the MoE blocks' routed experts on the kernel gives transformers' tokens, with
    chunked prefill."""
    calls: list[int] = []
    _on_triton(monkeypatch, calls)
    ckpt = checkpoint(arch)
    check_greedy(fp32_cpu_llm(ckpt, max_num_batched_tokens=16), oracle(ckpt), random_prompts(5, [3, 21, 9]))
    assert calls and max(calls) > 1 and min(calls) >= 1
