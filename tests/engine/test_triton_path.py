"""The engine's CUDA path (Triton attention + Triton SGMV LoRA) run on CPU through Triton's interpreter,
checked against the torch path and against PEFT."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # Triton kernels interpreted on CPU through the engine


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("triton_adapters")
    names = ["all7-r4", "pattern-r16", "layer1-r32"]
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(names)}
    return base, dirs, PeftGreedyOracle(base)


def test_triton_backends_match_peft_and_torch_path(setup):
    base, dirs, oracle = setup
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43, 44], [7] * 9]
    names = ["all7-r4", None, "pattern-r16", "layer1-r32"]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=32, max_num_batched_tokens=12)
    triton_llm = LLM(str(base), attention_backend="triton", lora_backend="triton", **kw)
    assert triton_llm.engine.runner.backend.name == "triton"
    got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, lora_request=loras)]
    torch_llm = LLM(str(base), **kw)
    ref = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params, lora_request=loras)]
    assert got == ref
    for prompt, name, tokens in zip(prompts, names, got, strict=True):
        assert tokens == oracle.greedy(prompt, 4, dirs[name] if name else None)
