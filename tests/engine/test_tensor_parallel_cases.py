"""Tensor parallel at TP=2 beyond the family checks: one KV head replicated on both ranks (GQA), n-gram
speculation, Llama's `attention_bias` and `mlp_bias` (q/k/v, o and gate/up/down biases; the row-parallel
o and down biases added by rank 0 only) equal to PEFT at TP=2 and TP=1, the adapter eviction/reload
cycle (the vLLM #20873 case), `n > 1` sampling equal to TP=1, bad sizes refused at start, and a killed
or hung worker ending the in-flight requests and the group restarting. One TP=2 engine (and one TP=1)
shared by the module."""

from __future__ import annotations

import os
import signal

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.llm_engine import LLMEngine
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

ADAPTERS = ("all7-r4", "qv-r8-rslora", "pattern-r16", "gud-r12")
NEW = 6
WATCHDOG = 10.0  # seconds an all-reduce waits for a hung rank
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def engine_kwargs(tp: int) -> dict:
    """Room for two rank-16 adapters on the device (pages of 8: 4 per module) and two in host memory,
    so cycling four adapters evicts and reloads each from disk."""
    return dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=16, max_loras=2) | dict(
        max_cpu_loras=2, lora_page_rank=8, lora_pool_pages=4, speculative="ngram", tensor_parallel_size=tp
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A llama with 4 heads and ONE KV head (replicated on both ranks) and random biases on every
    projection (`attention_bias`, `mlp_bias`), its adapters, the PEFT oracle and TP=2 / TP=1 engines."""
    root = tmp_path_factory.mktemp("tp-cases")
    base = build_checkpoint(root / "base", "llama", num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    dirs = {
        name: build_adapter(base, root / name, seed=i, **ADAPTER_SPECS[name])
        for i, name in enumerate(ADAPTERS)
    }
    tp2 = LLM(str(base), **engine_kwargs(2), distributed_timeout=WATCHDOG)
    tp1 = LLM(str(base), **engine_kwargs(1))
    yield base, dirs, PeftGreedyOracle(base), tp2, tp1
    tp2.engine.shutdown()


def lora(dirs, name):
    return LoRARequest(name, str(dirs[name])) if name else None


def test_projection_biases_equal_peft(setup):
    """Llama with q/k/v, o and gate/up/down biases, on the base model and under an adapter on all seven
    projections: TP=2 and TP=1 both give transformers + PEFT's greedy tokens."""
    _, dirs, oracle, tp2, tp1 = setup
    prompts = [[5, 9, 14, 3], [33, 4, 70, 12, 8, 41]]
    for name in (None, "all7-r4"):
        want = [oracle.greedy(p, NEW, dirs[name] if name else None) for p in prompts]
        for llm in (tp2, tp1):
            outs = llm.generate(prompts, GREEDY, lora_request=[lora(dirs, name)] * len(prompts))
            assert [o.outputs[0].token_ids for o in outs] == want, (name, llm.engine.tp is not None)


def test_eviction_reload_cycle_equal(setup):
    """Four adapters through a pool of two and a host cache of two, three rounds: each is evicted and
    reloaded at least twice, and every round gives PEFT's tokens (n-gram speculation on: the prompts
    repeat, so drafts are proposed and verified)."""
    _, dirs, oracle, llm, _ = setup
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    want = {name: oracle.greedy(prompt, NEW, dirs[name]) for name in ADAPTERS}
    for _ in range(3):
        for name in ADAPTERS:
            out = llm.generate([prompt], GREEDY, lora_request=lora(dirs, name))[0]
            assert out.outputs[0].token_ids == want[name], name
    pool = llm.engine.get_lora_stats()
    assert pool.device_uploads >= 2 * len(ADAPTERS) + len(ADAPTERS)
    assert pool.evictions >= 2 * len(ADAPTERS)
    assert pool.loads >= 2 * len(ADAPTERS)  # reread from disk: the host cache holds two
    assert llm.engine.get_stats().spec_proposed_tokens > 0


def test_sampling_n2_equal_tp1(setup):
    """Seeded sampling with n=2 on base and adapter rows: TP=2 draws what TP=1 draws, although the
    adaptive speculation of each picks its own k (step timings, and what each adapter's earlier requests
    accepted: this module's TP=2 engine has served more of them). A seeded token depends only on the seed
    and its position (engine/sampling_noise.py), not on how many proposals a verification had."""
    _, dirs, _, tp2, tp1 = setup
    params = SamplingParams(n=2, max_tokens=NEW, temperature=0.9, seed=7, ignore_eos=True)
    prompts = [[9, 10, 11, 12, 13], [40, 41, 42]]
    loras = [None, lora(dirs, "all7-r4")]
    got = [[c.token_ids for c in o.outputs] for o in tp2.generate(prompts, params, lora_request=loras)]
    want = [[c.token_ids for c in o.outputs] for o in tp1.generate(prompts, params, lora_request=loras)]
    assert got == want


def _kill_mid_request(llm: LLM, dirs, sig: int) -> list:
    """Start two requests, signal worker rank 1 after their first tokens, and step until both ended."""
    eng = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng.add_request("a", [3, 4, 5, 6], params)
    eng.add_request("b", [7, 8, 9], params, lora(dirs, "qv-r8-rslora"))
    ended = []
    for _ in range(2):
        ended += [o for o in eng.step() if o.finished]
    pid = eng.tp.group.worker_pids()[0]
    os.kill(pid, sig)
    while eng.has_unfinished_requests():
        ended += [o for o in eng.step() if o.finished]
    return ended


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_worker_fault_ends_requests_and_restarts(setup, sig):
    """A worker killed (or stopped, so the next all-reduce waits out `distributed_timeout`) mid-request:
    both requests end with the retryable error, the group restarts with new workers and the adapters
    they held, and the next requests give PEFT's tokens."""
    _, dirs, oracle, llm, _ = setup
    eng = llm.engine
    restarts, old = eng.tp.group.restarts, eng.tp.group.worker_pids()
    ended = _kill_mid_request(llm, dirs, sig)
    assert sorted(o.request_id for o in ended) == ["a", "b"]
    assert all(o.error and "retry" in o.error for o in ended)
    assert eng.tp.group.restarts == restarts + 1 and eng.tp.group.worker_pids() != old
    prompt = [11, 12, 13, 14]
    for name in ("qv-r8-rslora", None):
        out = llm.generate([prompt], GREEDY, lora_request=lora(dirs, name))[0]
        assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW, dirs[name] if name else None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
        (dict(tensor_parallel_size=2, num_threads=1), "more ranks than the 1 CPUs"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be"),
    ],
)
def test_bad_tensor_parallel_size_is_one_line_error(setup, kwargs, message):
    base = setup[0]
    with pytest.raises(ValueError, match=message) as err:
        LLMEngine.from_args(str(base), device="cpu", **kwargs)
    assert "\n" not in str(err.value)


def test_kv_heads_must_split():
    """6 heads over 3 KV heads at TP=2: the heads split, the KV heads neither split nor replicate."""
    from engine.distributed.shard import TensorParallelError, check_tensor_parallel
    from engine.model_config import ModelConfig

    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=48, num_attention_heads=6)
    raw |= dict(num_key_value_heads=3, num_hidden_layers=1, vocab_size=32, intermediate_size=64)
    with pytest.raises(TensorParallelError, match="3 KV heads"):
        check_tensor_parallel(ModelConfig.from_dict(raw), 2)
