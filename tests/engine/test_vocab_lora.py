"""LoRA on embed_tokens and lm_head serves in mixed batches equal to PEFT (float32): base rows, plain
LoRA rows, embedding-LoRA rows, LM-head-LoRA rows and an adapter with only those two, in one batch; on
Llama (untied head), Qwen2 (tied embeddings: the two LoRAs stay independent, as in PEFT), Granite (the
embedding multiplier and logit scaling around the deltas) and Gemma 2 (√hidden embedding scale,
soft-capped logits); both CPU LoRA backends, chunked prefill with a small pool, n-gram speculation (several
logits rows per sequence) and the Triton path (interpreted) with decode graphs on."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.tiny_adapters import VOCAB_ADAPTER_SPECS, PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 6
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


def _check(llm: LLM, dirs, oracle, seed: int, n: int, logprobs: bool = False) -> None:
    """n prompts of mixed lengths, each on an adapter or the base, in one batch; tokens (and with
    `logprobs` each token's log-probability, 1e-4) equal PEFT's."""
    rng = random.Random(seed)
    names = [*dirs, None]
    reqs = [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))], names[i % len(names)]) for i in range(n)
    ]
    loras = [LoRARequest(name, str(dirs[name])) if name else None for _, name in reqs]
    params = SamplingParams(
        max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1 if logprobs else None
    )
    outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    for (prompt, name), out in zip(reqs, outs, strict=True):
        comp = out.outputs[0]
        adapter = dirs[name] if name else None
        assert comp.token_ids == oracle.greedy(prompt, NEW, adapter), f"adapter {name}"
        if logprobs:
            ref = torch.log_softmax(oracle.logits(prompt + comp.token_ids, adapter), -1)
            for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
                want = float(ref[len(prompt) - 1 + i, tok])
                assert entry[tok].logprob == pytest.approx(want, abs=1e-4), name
    assert llm.engine.get_stats().kv_blocks_used == 0


def _llm(base, **kwargs) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 16, "max_loras": 4}
    return LLM(str(base), **(defaults | kwargs))


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
    llm = _llm(base, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    _check(llm, dirs, oracle, seed=1, n=2 * (len(dirs) + 1), logprobs=True)


def test_vocab_lora_under_chunked_prefill_and_a_small_pool(adapters):
    """Prefill chunks of 7 tokens (so a prompt's embedding rows span steps) and 2 resident adapters
    (so vocabulary copies are evicted and uploaded again)."""
    base, dirs, oracle = adapters["qwen2"]
    llm = _llm(base, max_num_batched_tokens=7, max_loras=2, num_kv_blocks=40)
    _check(llm, dirs, oracle, seed=2, n=10)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_speculative_decoding_with_lm_head_lora_matches_peft(backend, adapters):
    """n-gram speculation scores several logits rows per sequence; each gets its adapter's head LoRA."""
    base, dirs, oracle = adapters["llama"]
    llm = _llm(base, lora_backend=backend, speculative="ngram", num_speculative_tokens=3)
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
    llm = _llm(base, attention_backend="triton", lora_backend="triton")
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
