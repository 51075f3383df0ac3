"""DoRA (`use_dora`) and LoRA-bias (`lora_bias`) adapters serve in mixed batches equal to PEFT's merge-free
forward (float32): base rows, plain LoRA rows and DoRA rows in one batch, on Llama (no projection biases),
Qwen2 (q/k/v biases, the terms DoRA must not scale), Phi-3 (DoRA on the fused qkv_proj / gate_up_proj,
whose norms and magnitudes split per slice), Granite and Gemma 2; both CPU LoRA backends, the Triton path
(interpreted) with and without decode graphs; chunked prefill; the norm itself equals PEFT's, on dense and
packed weights."""

from __future__ import annotations

import pytest
import torch

from engine.lora.adapter_checkpoint import inspect_adapter
from engine.lora.dora import ProjectionBaseWeights, dora_weight_norm
from engine.model.loader import load_model
from engine.model_config import ModelConfig
from tests.engine.peft_cases import PLAIN_R4, build_cases, check_greedy, triton_llm_replaying_plain_lora
from tests.helpers.peft_batch import check_mixed_batch, cpu_llm

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DORA_R4 = dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True)
SPECS = {
    "llama": {
        "plain-r4": PLAIN_R4,
        "dora-r4": DORA_R4,
        "dora-r8-rslora": dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
            use_dora=True,
            use_rslora=True,
        ),
    },
    "qwen2": {  # lora_bias needs a base bias (PEFT): Qwen2's q/k/v have one
        "plain-r4": PLAIN_R4,
        "dora-r4": DORA_R4,
        "bias-r8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True),
    },
    "granite": {
        "plain-r4": PLAIN_R4,
        "dora-r4": DORA_R4,
    },
    "gemma2": {
        "plain-r4": PLAIN_R4,
        "dora-r4": DORA_R4,
    },
    "phi3": {
        "plain-r4": PLAIN_R4,
        "dora-fused-r4": dict(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True),
    },
}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir}, PEFT oracle); magnitudes and B are random."""
    return build_cases(checkpoint, tmp_path_factory, SPECS, "dora", seed=10)


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
    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton", max_num_batched_tokens=12)
    check_greedy(llm, dirs, oracle, prompts, names, 4)


def test_decode_graphs_leave_dora_steps_eager(adapters):
    """With decode graphs on, steps that carry DoRA / lora_bias rows run eagerly (their epilogue indexes
    the step's rows) and still equal PEFT; plain-LoRA decode steps still replay graphs."""
    base, dirs, oracle = adapters["qwen2"]
    llm = triton_llm_replaying_plain_lora(base, dirs, oracle)
    names = ["dora-r4", "plain-r4", None, "bias-r8"]
    prompts = [[9, 10, 11, 12], [13, 14], [15, 16, 17], [18, 19, 20, 21, 22]]
    check_greedy(llm, dirs, oracle, prompts, names, 4)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_speculative_decoding_with_dora_matches_peft(backend, adapters):
    """n-gram speculation: verification runs score several rows per DoRA sequence; greedy tokens equal
    PEFT's. Repetitive prompts so proposals are made (and some accepted)."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, lora_backend=backend, speculative="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 3, 4, 3]]
    names = ["dora-r4", "dora-r8-rslora", None]
    check_greedy(llm, dirs, oracle, prompts, names, 8)
    assert llm.engine.get_stats().spec_proposed_tokens > 0
