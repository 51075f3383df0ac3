"""Decode graphs stay valid while the adapter pool changes, next to speculative verification steps, and
base-only steps launch no LoRA kernel (`engine/decode_graphs.py`, `engine/lora/backend.py`), on CPU.

The graphs are `CheckedReplay` stand-ins (tests/helpers/graph_check.py): every replay must launch the
same interpreted Triton kernels, grids and scalars as its capture, with every tensor that lives outside
the pass at the same address — what a real CUDA graph replays — and its tokens must equal HF + PEFT's.
"""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.backend import BGMV_MAX_ROWS, lora_kernel_for, max_rows_per_adapter
from tests.helpers.graph_check import CheckedReplay, engine_tensors, recording_launches
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter

NAMES = ["all7-r4", "pattern-r16", "gud-r12"]
KW = dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=16)
KW |= dict(attention_backend="triton", lora_backend="triton", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("graph_pool_adapters")
    dirs = {n: build_adapter(base, root / n, seed=10 + i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    return base, dirs, PeftGreedyOracle(base)


def _graph_llm(base, capture_max: int = 4, **kw) -> tuple[LLM, CheckedReplay]:
    llm = LLM(str(base), **(KW | kw))
    eng = llm.engine
    checked = CheckedReplay(engine_tensors(eng))
    eng.runner.use_decode_graphs(checked, eng.lora.pool, max_batch=capture_max)
    return llm, checked


def _check_round(llm, oracle, dirs, prompts, names, n) -> None:
    loras = [LoRARequest(x, str(dirs[x])) if x else None for x in names]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, n, dirs[name] if name else None), name


def test_kernel_rule() -> None:
    assert max_rows_per_adapter([3, -1, 3, 0, -1, -1]) == 2 and max_rows_per_adapter([-1, -1]) == 0
    assert lora_kernel_for(1) == lora_kernel_for(BGMV_MAX_ROWS) == "bgmv"
    assert lora_kernel_for(BGMV_MAX_ROWS + 1) == "sgmv"


@pytest.mark.slow
def test_graphs_stay_valid_while_adapters_are_loaded_and_evicted(setup):
    base, dirs, oracle = setup
    # room for two rank-16 adapters per projection: the third one evicts the least recently used
    llm, checked = _graph_llm(base, max_loras=2, lora_pool_pages=2)
    eng = llm.engine
    graphs = eng.runner.graphs
    assert graphs is not None
    stats = graphs.capture_all()
    keys = [(4, None), (4, "bgmv"), (2, None), (2, "bgmv"), (1, None), (1, "bgmv")]
    assert graphs.graph_keys() == keys and stats.graphs == checked.captures == 6
    assert stats.capture_s > 0 and stats.memory_bytes == 0

    prompts = [[5, 6, 7, 8, 9], [12, 13], [40, 41, 42]]
    _check_round(llm, oracle, dirs, prompts, ["all7-r4", "pattern-r16", None], 4)
    _check_round(llm, oracle, dirs, prompts, ["gud-r12", "all7-r4", None], 4)  # evicts pattern-r16
    _check_round(llm, oracle, dirs, prompts[:2], ["pattern-r16", "gud-r12"], 3)  # evicts all7-r4
    assert eng.lora.stats().evictions >= 2
    assert checked.captures == 6 and checked.replays >= 8 and checked.launches_checked > 0
    assert set(graphs.captured) == set(keys)  # every step replayed a graph captured at start

    _check_round(llm, oracle, dirs, prompts, [None, None, None], 3)
    assert checked.kernels and not any(k.startswith("_lora") for k in checked.kernels)  # base-only graph


@pytest.mark.slow
def test_base_only_steps_launch_no_lora_kernel_and_prefill_takes_sgmv(setup):
    base, dirs, _ = setup
    llm = LLM(str(base), **KW)  # eager: every launch of every step is recorded
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with recording_launches() as base_only:
        llm.generate([[5, 6, 7], [8, 9]], params)
    assert base_only and not any(name.startswith("_lora") for name, *_ in base_only)
    lora = LoRARequest("all7-r4", str(dirs["all7-r4"]))
    with recording_launches() as mixed:
        llm.generate([list(range(3, 3 + BGMV_MAX_ROWS + 4)), [8, 9]], params, lora_request=[lora, None])
    names = [name for name, *_ in mixed]
    assert "_lora_shrink_kernel" in names and "_lora_expand_kernel" in names  # the 20-row prefill chunk
    assert "_lora_bgmv_kernel" in names  # the decode steps


@pytest.mark.slow
def test_graphs_next_to_speculative_verification_steps(setup):
    base, dirs, oracle = setup
    llm, checked = _graph_llm(base, speculative="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 3, 4, 3]]
    names = ["all7-r4", None, "pattern-r16"]
    _check_round(llm, oracle, dirs, prompts, names, 8)
    assert llm.engine.get_stats().spec_proposed_tokens > 0  # verification steps ran (eagerly)
    assert checked.replays >= 1  # and plain decode steps from graphs


def test_checked_replay_fails_on_a_step_dependent_launch() -> None:
    """The check can fail: a pass whose grid follows the step, or that reads a copy of the page table."""
    import torch

    from kernels.lora_bgmv import lora_bgmv
    from tests.kernels.lora_case import make_case

    case = make_case([[4, 8], [8, 0]], [0, 1, -1], 16, [16, 8], 8, torch.float32)
    y = torch.zeros(3, 24)
    state = {"meta": case.meta, "table": case.page_table}

    def forward() -> torch.Tensor:
        args = (case.a_pools, case.b_pools, state["table"], case.ranks, case.scalings, state["meta"])
        lora_bgmv(case.x, *args, y)
        return y.clone()

    checked = CheckedReplay(lambda: [case.page_table, *case.a_pools, *case.b_pools, case.ranks])
    replay, _ = checked.capture(forward)
    replay()  # the same launches: fine
    state["table"] = case.page_table.clone()
    with pytest.raises(AssertionError, match="differs from its capture"):
        replay()
    state["table"] = case.page_table
    state["meta"] = make_case([[4, 8], [8, 0]], [0, 0, 1], 16, [16, 8], 8, torch.float32).meta
    with pytest.raises(AssertionError, match="differs from its capture"):
        replay()  # two segments instead of three: another grid
