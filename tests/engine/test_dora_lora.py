"""DoRA (`use_dora`) and LoRA-bias (`lora_bias`) adapters serve in mixed batches equal to PEFT's merge-free
forward (float32): base rows, plain LoRA rows and DoRA rows in one batch, on Llama (no projection biases),
Qwen2 (q/k/v biases, the terms DoRA must not scale), Phi-3 (DoRA on the fused qkv_proj / gate_up_proj,
whose norms and magnitudes split per slice), Granite and Gemma 2; both CPU LoRA backends, the Triton path
(interpreted) with and without decode graphs; chunked prefill; the norm itself equals PEFT's, on dense and
packed weights."""

from __future__ import annotations

import pytest
import torch

from engine import LoRARequest, SamplingParams
from engine.lora.adapter_checkpoint import inspect_adapter
from engine.lora.dora import ProjectionBaseWeights, dora_weight_norm
from engine.model.loader import load_model
from engine.model_config import ModelConfig
from tests.helpers.peft_batch import check_mixed_batch, cpu_llm
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {
    "llama": {
        "plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "dora-r4": dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True),
        "dora-r8-rslora": dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
            use_dora=True,
            use_rslora=True,
        ),
    },
    "qwen2": {  # lora_bias needs a base bias (PEFT): Qwen2's q/k/v have one
        "plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "dora-r4": dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True),
        "bias-r8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True),
    },
    "granite": {
        "plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "dora-r4": dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True),
    },
    "gemma2": {
        "plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "dora-r4": dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True),
    },
    "phi3": {
        "plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
        "dora-fused-r4": dict(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True),
    },
}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir}, PEFT oracle); magnitudes and B are random."""
    out = {}
    for arch, specs in SPECS.items():
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"dora_{arch}")
        dirs = {n: build_adapter(base, root / n, seed=10 + i, **s) for i, (n, s) in enumerate(specs.items())}
        out[arch] = (base, dirs, PeftGreedyOracle(base))
    return out


@pytest.mark.parametrize(
    ("arch", "backend"),
    [
        ("llama", "native"),
        ("llama", "torch"),
        ("qwen2", "native"),
        ("qwen2", "torch"),
        ("phi3", "native"),
        ("phi3", "torch"),
        ("granite", "native"),
        ("gemma2", "native"),
    ],
)
def test_mixed_batch_with_dora_matches_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    check_mixed_batch(llm, dirs, oracle, seed=1, n=2 * (len(dirs) + 1), logprobs=True)


def test_dora_under_chunked_prefill_and_a_small_pool(adapters):
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, max_num_batched_tokens=7, max_loras=2, num_kv_blocks=40)
    check_mixed_batch(llm, dirs, oracle, seed=2, n=10)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_dora_norm_equals_peft(arch, packed, adapters):
    """The norm from G = A·Wᵀ and the base row norms equals PEFT's ‖W + s·B·A‖ per row, per slice."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, dirs, _ = adapters[arch]
    name = next(n for n in dirs if n.startswith("dora"))
    cfg = ModelConfig.from_dir(base)
    model = load_model(cfg, torch.float32, torch.device("cpu"))
    if packed:
        assert model.pack_cpu_gemms()
    weights = ProjectionBaseWeights(model)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), dirs[name]
    )
    ckpt = inspect_adapter(dirs[name], cfg, max_lora_rank=16)
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
    fused |= {"up_proj": "gate_up_proj"}
    rows: dict[tuple[int, str], int] = {}
    for w in ckpt.modules:
        target = fused.get(w.module, w.module) if arch == "phi3" else w.module
        layer = peft.base_model.model.model.layers[w.layer]
        lin = getattr(layer.self_attn if "proj" in target and target[0] in "qkvo" else layer.mlp, target)
        with torch.no_grad():
            lora_w = lin.lora_B["default"].weight @ lin.lora_A["default"].weight
            ref = lin.lora_magnitude_vector["default"].get_weight_norm(
                lin.get_base_layer().weight, lora_w, lin.scaling["default"]
            )
        start = rows.get((w.layer, target), 0)
        got = dora_weight_norm(w, weights)
        torch.testing.assert_close(got, ref[start : start + len(got)], rtol=1e-5, atol=1e-5)
        rows[(w.layer, target)] = start + len(got)


def test_triton_path_applies_dora_after_the_expand(adapters):
    """The CUDA path (Triton SGMV, interpreted on CPU here): DoRA rows scaled in torch after the expand."""
    base, dirs, oracle = adapters["qwen2"]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43, 44], [7] * 9]
    names = ["dora-r4", None, "plain-r4", "bias-r8"]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton", max_num_batched_tokens=12)
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, 4, dirs[name] if name else None), name


def test_decode_graphs_leave_dora_steps_eager(adapters):
    """With decode graphs on, steps that carry DoRA / lora_bias rows run eagerly (their epilogue indexes
    the step's rows) and still equal PEFT; plain-LoRA decode steps still replay graphs."""
    from engine.decode_graphs import EagerReplay

    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton")
    eng = llm.engine
    eng.runner.use_decode_graphs(EagerReplay(), eng.lora.pool, max_batch=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params, lora_request=[LoRARequest("plain-r4", str(dirs["plain-r4"]))])
    assert eng.runner.graphs is not None and any(lo for _, lo in eng.runner.graphs.captured)
    assert plain[0].outputs[0].token_ids == oracle.greedy([5, 6, 7], 4, dirs["plain-r4"])
    names = ["dora-r4", "plain-r4", None, "bias-r8"]
    prompts = [[9, 10, 11, 12], [13, 14], [15, 16, 17], [18, 19, 20, 21, 22]]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, 4, dirs[name] if name else None), name


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_speculative_decoding_with_dora_matches_peft(backend, adapters):
    """n-gram speculation: verification runs score several rows per DoRA sequence; greedy tokens equal
    PEFT's. Repetitive prompts so proposals are made (and some accepted)."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, lora_backend=backend, speculative="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 3, 4, 3]]
    names = ["dora-r4", "dora-r8-rslora", None]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, 8, dirs[name] if name else None), name
    assert llm.engine.get_stats().spec_proposed_tokens > 0
