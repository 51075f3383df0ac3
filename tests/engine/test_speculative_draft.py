"""Draft-model speculation (`speculative="draft:PATH"`): the draft runs without adapters in its own paged
KV cache; greedy outputs equal non-speculative decoding for mixed adapters, and neither cache leaks."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.engine.test_speculative import ADAPTERS, _repetitive_workload
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter

pytestmark = pytest.mark.slow  # tiny engines with a second model

NEW = 16


@pytest.fixture(scope="module")
def llama(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("draft_adapters")
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(ADAPTERS)}
    return base, dirs


def _llm(base, **kw) -> LLM:
    return LLM(
        str(base), **({"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 32} | kw)
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["roomy", "chunked-preempting"])
def test_draft_equal_to_target_is_accepted_for_base_requests_only_and_output_is_unchanged(llama, chunked):
    base, dirs = llama
    kw = {"max_num_batched_tokens": 9, "num_kv_blocks": 18, "max_loras": 2} if chunked else {}
    reqs = _repetitive_workload(dirs, seed=3, n=10)
    loras = [LoRARequest(n, str(dirs[n])) if n else None for _, n in reqs]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    plain = _llm(base, **kw).generate([p for p, _ in reqs], params, lora_request=loras)
    llm = _llm(base, speculative=f"draft:{base}", num_speculative_tokens=3, **kw)
    llm.engine.spec.cost.fixed_theta = 0.05  # speculate whatever this machine's timings
    spec = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    for a, b in zip(plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    by = llm.engine.get_stats().spec_by_adapter
    proposed, accepted, _ = by[""]
    assert accepted == proposed > 0  # the draft is the base model: every proposal for a base request lands
    assert any(v[1] < v[0] for name, v in by.items() if name)  # adapters change the output: rejections
    eng = llm.engine
    assert eng.kv.pool.num_free == eng.num_kv_blocks
    draft = eng.spec.proposer
    assert not draft.shadows and draft.kv.pool.num_free == draft.kv.pool.num_blocks
    if chunked:
        assert eng.get_stats().num_preemptions > 0


def test_a_different_draft_model_and_bad_drafts(llama, checkpoint):
    base, dirs = llama
    other = checkpoint("qwen2", seed=5)  # another architecture, same vocabulary
    reqs = _repetitive_workload(dirs, seed=4, n=6)
    loras = [LoRARequest(n, str(dirs[n])) if n else None for _, n in reqs]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    plain = _llm(base).generate([p for p, _ in reqs], params, lora_request=loras)
    llm = _llm(base, speculative=f"draft:{other}", num_speculative_tokens=2)
    llm.engine.spec.cost.fixed_theta = 0.05
    spec = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.get_stats().spec_proposed_tokens > 0
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(base, speculative=f"draft:{checkpoint('llama', vocab_size=128)}")
    with pytest.raises(ValueError, match=r"no config\.json"):
        _llm(base, speculative="draft:/nonexistent/draft")
