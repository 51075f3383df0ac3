"""Speculative decoding (n-gram proposer): greedy tokens equal non-speculative decoding for mixed-adapter
batches on two architectures, with chunked prefill, preemption and prefix caching, and no KV blocks leak
after rollbacks, aborts and preemptions."""

from __future__ import annotations

import random

import pytest

from engine import LLM, LLMEngine, LoRARequest, SamplingParams
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # several tiny engines per test

NEW = 24
ADAPTERS = ("all7-r4", "qv-r8-rslora", "gud-r12")


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """For llama and qwen2: (base dir, {name: adapter dir})."""
    out = {}
    for arch in ("llama", "qwen2"):
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"spec_adapters_{arch}")
        dirs = {
            name: build_adapter(base, root / name, seed=i, **ADAPTER_SPECS[name])
            for i, name in enumerate(ADAPTERS)
        }
        out[arch] = (base, dirs)
    return out


def _llm(base, **kwargs) -> LLM:
    return LLM(
        str(base), **({"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 32} | kwargs)
    )


def _repetitive_workload(dirs, seed: int, n: int):
    """n requests on random adapters (or none) whose prompts repeat a short random phrase, so prompt
    lookup finds matches, plus a shared prefix for some of them (prefix-cache hits)."""
    rng = random.Random(seed)
    names = [*dirs, None]
    shared = [rng.randrange(3, 96) for _ in range(9)]
    reqs = []
    for i in range(n):
        phrase = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 6))]
        prompt = (shared if i % 3 == 0 else []) + phrase * rng.randrange(2, 6)
        reqs.append((prompt, names[rng.randrange(len(names))]))
    return reqs


def _generate(llm: LLM, dirs, reqs, params: SamplingParams):
    loras = [LoRARequest(name, str(dirs[name])) if name else None for _, name in reqs]
    return llm.generate([p for p, _ in reqs], params, lora_request=loras)


def _assert_no_leaks(eng: LLMEngine) -> None:
    assert eng.kv.pool.num_free == eng.num_kv_blocks
    assert eng.kv.num_requests() == 0
    assert eng.scheduler.running_adapters() == set()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # chunked prefill (budget 9 rows, also shared by speculative rows) and preemption (tiny cache)
        {"max_num_batched_tokens": 9, "num_kv_blocks": 30, "max_loras": 2},
    ],
    ids=["roomy", "chunked-preempting"],
)
def test_greedy_mixed_adapters_equal_non_speculative(arch, engine_kwargs, adapters):
    base, dirs = adapters[arch]
    reqs = _repetitive_workload(dirs, seed=7, n=14)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    plain = _generate(_llm(base, **engine_kwargs), dirs, reqs, params)
    llm = _llm(base, speculative="ngram", num_speculative_tokens=4, **engine_kwargs)
    llm.engine.spec.cost.fixed_theta = 0.05  # speculate whatever this machine's timings (reproducible)
    spec = _generate(llm, dirs, reqs, params)
    for (prompt, name), a, b in zip(reqs, plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"adapter {name}, prompt {prompt}"
    stats = llm.engine.get_stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens  # rollbacks happened too
    assert len([a for a, v in stats.spec_by_adapter.items() if v[1] > 0]) >= 2  # several adapters gained
    if engine_kwargs:
        assert stats.num_preemptions > 0
    else:  # and so equal to HF transformers + PEFT, run one request at a time
        oracle = PeftGreedyOracle(base)
        for (prompt, name), out in list(zip(reqs, spec, strict=True))[:6]:
            assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW, dirs[name] if name else None)
    assert stats.prefix_cache_hits > 0
    _assert_no_leaks(llm.engine)


def test_verification_through_the_triton_kernels(adapters):
    """The CUDA path (Triton paged attention + SGMV LoRA, interpreted on CPU) verifies k + 1 rows per
    sequence next to plain decodes and gives the torch path's greedy tokens."""
    base, dirs = adapters["llama"]
    reqs = [([5, 6, 7] * 3, "all7-r4"), ([12, 13, 14, 12, 13], None), ([40, 41] * 4, "gud-r12")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = _generate(_llm(base), dirs, reqs, params)
    llm = _llm(
        base, attention_backend="triton", lora_backend="triton", speculative="ngram", num_speculative_tokens=3
    )
    llm.engine.spec.cost.fixed_theta = 0.05
    spec = _generate(llm, dirs, reqs, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.get_stats().spec_accepted_tokens > 0
