"""LoRA on embed_tokens and lm_head serves in mixed batches equal to PEFT (float32): base rows, plain
LoRA rows, embedding-LoRA rows, LM-head-LoRA rows and an adapter with only those two, in one batch; on
Llama (untied head), Qwen2 (tied embeddings: the two LoRAs stay independent, as in PEFT), Granite (the
embedding multiplier and logit scaling around the deltas) and Gemma 2 (√hidden embedding scale,
soft-capped logits); both CPU LoRA backends, chunked prefill with a small pool, n-gram speculation (several
logits rows per sequence) and the Triton path (interpreted) with decode graphs on."""

from __future__ import annotations

import pytest

from engine import LoRARequest, SamplingParams
from tests.helpers.peft_batch import check_mixed_batch, cpu_llm
from tests.helpers.tiny_adapters import VOCAB_ADAPTER_SPECS, PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

SPECS = {"plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear")} | VOCAB_ADAPTER_SPECS


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per family: (base dir, {name: adapter dir}, PEFT oracle); A and B are random."""
    out = {}
    for arch in ("llama", "qwen2", "granite", "gemma2"):
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"vocab_{arch}")
        dirs = {n: build_adapter(base, root / n, seed=20 + i, **s) for i, (n, s) in enumerate(SPECS.items())}
        out[arch] = (base, dirs, PeftGreedyOracle(base))
    return out


@pytest.mark.parametrize(
    ("arch", "backend"),
    [
        ("llama", "native"),
        ("llama", "torch"),
        ("qwen2", "native"),
        ("qwen2", "torch"),
        ("granite", "native"),
        ("gemma2", "torch"),
    ],
)
def test_mixed_batch_with_vocab_lora_matches_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = cpu_llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    check_mixed_batch(llm, dirs, oracle, seed=1, n=2 * (len(dirs) + 1), logprobs=True)


def test_vocab_lora_under_chunked_prefill_and_a_small_pool(adapters):
    """Prefill chunks of 7 tokens (so a prompt's embedding rows span steps) and 2 resident adapters
    (so vocabulary copies are evicted and uploaded again)."""
    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, max_num_batched_tokens=7, max_loras=2, num_kv_blocks=40)
    check_mixed_batch(llm, dirs, oracle, seed=2, n=10)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_speculative_decoding_with_lm_head_lora_matches_peft(backend, adapters):
    """n-gram speculation scores several logits rows per sequence; each gets its adapter's head LoRA."""
    base, dirs, oracle = adapters["llama"]
    llm = cpu_llm(base, lora_backend=backend, speculative="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 3, 4, 3], [8, 9, 8, 9, 8]]
    names = ["head-v-r8", "both-only-rslora", None, "embed-q-r4"]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, 8, dirs[name] if name else None), name
    assert llm.engine.get_stats().spec_proposed_tokens > 0


def test_triton_path_and_decode_graphs_with_vocab_lora(adapters):
    """The CUDA path (Triton SGMV, interpreted on CPU here) with decode graphs on: steps with vocabulary
    LoRA rows run eagerly and equal PEFT; plain-LoRA decode steps still replay graphs."""
    from engine.decode_graphs import EagerReplay

    base, dirs, oracle = adapters["qwen2"]
    llm = cpu_llm(base, attention_backend="triton", lora_backend="triton")
    eng = llm.engine
    eng.runner.use_decode_graphs(EagerReplay(), eng.lora.pool, max_batch=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params, lora_request=[LoRARequest("plain-r4", str(dirs["plain-r4"]))])
    assert eng.runner.graphs is not None and any(lo for _, lo in eng.runner.graphs.captured)
    assert plain[0].outputs[0].token_ids == oracle.greedy([5, 6, 7], 4, dirs["plain-r4"])
    names = ["embed-q-r4", "plain-r4", None, "head-v-r8", "both-only-rslora"]
    prompts = [[9, 10, 11, 12], [13, 14], [15, 16, 17], [18, 19, 20, 21, 22], [23, 24, 25]]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, 4, dirs[name] if name else None), name
