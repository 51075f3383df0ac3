"""bfloat16 models with adapters: the native kernel (bfloat16 activations and pages) vs HF + PEFT in bfloat16,
and the `dtype="auto"` choice on CPU.

Two bfloat16 implementations round differently (fused q|k|v, attention, summation order), so a near-tie
between two logits may go either way and the sequences then part. The check is therefore: every token the
engine picks is (near) the argmax of PEFT's bfloat16 logits on the engine's own sequence (teacher-forced),
and most requests agree with PEFT's greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.cpu_features import native_bfloat16
from engine.model_config import ModelConfig, dtype_reason, resolve_dtype
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, bf16_gaps_vs_noise, build_adapter
from tests.helpers.tiny_models import build_checkpoint

NEW = 8
TIE = 2.0  # a token this many "PEFT bf16 noise" units below PEFT's max logit still counts as a tie


@pytest.fixture(scope="module")
def bf16_setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters_bf16")
    dirs = {n: build_adapter(base, root / n, seed=i, **s) for i, (n, s) in enumerate(ADAPTER_SPECS.items())}
    return base, dirs, (PeftGreedyOracle(base, dtype=torch.bfloat16), PeftGreedyOracle(base))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_mixed_adapters_in_bfloat16_follow_peft(backend, bf16_setup):
    base, dirs, oracles = bf16_setup
    llm = LLM(str(base), device="cpu", dtype="bfloat16", block_size=4, max_lora_rank=32, max_loras=4,
              lora_backend=backend)  # fmt: skip
    assert llm.engine.lora.backend == backend and llm.engine.lora.pool.dtype == torch.bfloat16
    names = [*dirs, None]
    reqs = [([(7 * i + 3 * j) % 90 + 3 for j in range(5 + 3 * i)], names[i % len(names)]) for i in range(14)]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for _, n in reqs]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    exact = 0
    for (prompt, name), out in zip(reqs, outs, strict=True):
        ours = out.outputs[0].token_ids
        adapter = dirs[name] if name else None
        gaps = bf16_gaps_vs_noise(oracles, prompt, ours, adapter)
        assert gaps.max() <= TIE, (
            f"adapter {name}: token {int(gaps.argmax())} is {gaps.max():.2f} noise below"
        )
        exact += ours == oracles[0].greedy(prompt, NEW, adapter)
    # Which near-ties part depends on the CPU's bf16 GEMM kernels: 12-14/14 on an AVX-512 BF16 Xeon, 11/14
    # on an AVX2-only EPYC. The per-token check above is the one a wrong adapter fails.
    assert exact > len(reqs) // 2, f"only {exact}/{len(reqs)} requests equal PEFT's greedy tokens"


def test_a_broken_adapter_scale_is_caught(bf16_setup, tmp_path):
    """The check above can fail: serving an adapter whose B is doubled leaves PEFT's argmax."""
    from safetensors.torch import load_file, save_file

    base, dirs, oracles = bf16_setup
    src = dirs["all7-r4"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    save_file(
        {k: v * 2 if "lora_B" in k else v for k, v in tensors.items()}, bad / "adapter_model.safetensors"
    )
    llm = LLM(
        str(base), device="cpu", dtype="bfloat16", block_size=4, max_lora_rank=32, lora_backend="native"
    )
    prompts = [[(5 * i + j) % 90 + 3 for j in range(6 + i)] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
                        lora_request=LoRARequest("bad", str(bad)))  # fmt: skip
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        worst = max(worst, float(bf16_gaps_vs_noise(oracles, prompt, ours, src).max()))
    assert worst > 5 * TIE


def test_auto_dtype_on_cpu_is_bfloat16_only_where_native(tmp_path):
    """A bfloat16 checkpoint: bfloat16 where the CPU multiplies it natively, else float32; float32 stays."""
    bf16 = ModelConfig.from_dir(build_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16))
    fp32 = ModelConfig.from_dir(build_checkpoint(tmp_path / "fp32", "llama"))
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if native_bfloat16() else torch.float32
    assert resolve_dtype("auto", bf16, cpu) == expected
    assert resolve_dtype("auto", fp32, cpu) == torch.float32
    assert resolve_dtype("bfloat16", fp32, cpu) == torch.bfloat16  # explicit choices are honoured
    reason = dtype_reason("auto", bf16, cpu)
    assert ("natively" in reason) == (expected == torch.bfloat16) and "bfloat16" in reason
    assert dtype_reason("float32", bf16, cpu) == "as configured"
