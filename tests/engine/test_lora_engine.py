"""Mixed-adapter batches: greedy tokens equal HF PEFT run per request, however the engine batches them."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LLMEngine, LoRARequest, SamplingParams
from engine.lora.adapter_checkpoint import AdapterError
from tests.engine.peft_cases import build_cases
from tests.helpers.tiny_adapters import ADAPTER_SPECS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 8


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """For llama and qwen2: (base dir, {name: adapter dir}, PEFT oracle)."""
    specs = dict.fromkeys(("llama", "qwen2"), ADAPTER_SPECS)
    return build_cases(checkpoint, tmp_path_factory, specs, "adapters", seed=0)


def _llm(base, **kwargs) -> LLM:
    """The tests' engine: float32 on CPU, 4-token KV blocks, adapters up to rank 32; `kwargs` override."""
    return LLM(
        str(base), **({"device": "cpu", "dtype": "float32", "block_size": 4, "max_lora_rank": 32} | kwargs)
    )


def _workload(dirs, seed: int, n: int):
    """n requests: prompts of mixed lengths, each with a random adapter or none."""
    rng = random.Random(seed)
    names = [*dirs, None]
    reqs = []
    for _ in range(n):
        name = names[rng.randrange(len(names))]
        prompt = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))]
        reqs.append((prompt, name))
    return reqs


def _run_and_check(llm: LLM, dirs, oracle, reqs, oracle_dirs=None):
    """Serve `reqs` with the adapters in `dirs`; PEFT runs the ones in `oracle_dirs` (default: the same)."""
    oracle_dirs = oracle_dirs or dirs
    loras = [LoRARequest(name, str(dirs[name])) if name else None for _, name in reqs]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    for (prompt, name), out in zip(reqs, outs, strict=True):
        expected = oracle.greedy(prompt, NEW, oracle_dirs[name] if name else None)
        assert out.outputs[0].token_ids == expected, f"adapter {name}"
    eng = llm.engine
    assert eng.get_stats().kv_blocks_used == 0
    assert eng.scheduler.running_adapters() == set()
    pool = eng.lora.pool
    assert pool.pages_used() == sum(r.num_pages for r in pool.resident.values())


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_adapters_match_peft(arch, backend, adapters):
    base, dirs, oracle = adapters[arch]
    llm = _llm(base, max_loras=3, lora_backend=backend)
    assert llm.engine.lora.backend == backend
    _run_and_check(llm, dirs, oracle, _workload(dirs, seed=1, n=14))


@pytest.mark.parametrize("lora_dtype", ["float16", "bfloat16"])
def test_narrow_adapter_pages_under_a_float32_model(lora_dtype, adapters, tmp_path):
    """`lora_dtype` keeps adapter pages in half precision (half the bytes per decode step) and widens
    them to float32 when applied: greedy tokens equal PEFT's float32 run of the rounded adapters."""
    base, dirs, oracle = adapters["llama"]
    dtype = getattr(torch, lora_dtype)
    rounded = {name: _rounded_copy(d, tmp_path / name, dtype) for name, d in dirs.items()}
    llm = _llm(base, lora_dtype=lora_dtype)
    assert llm.engine.lora.pool.a[0].dtype == dtype
    assert llm.engine.lora.backend == "native"
    _run_and_check(llm, dirs, oracle, _workload(dirs, seed=3, n=10), oracle_dirs=rounded)


def _rounded_copy(src, dst, dtype):
    """A copy of the adapter at `src` whose weights are rounded to `dtype` (and stored as float32)."""
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v.to(dtype).float() for k, v in tensors.items()}, weights)
    return dst


def test_lora_backend_and_dtype_choices_are_checked(adapters):
    base, _, _ = adapters["llama"]
    for kwargs, message in (
        ({"lora_backend": "cuda"}, "lora backend must be one of"),
        ({"lora_dtype": "float8"}, "lora_dtype 'float8' is not supported"),
        ({"lora_backend": "triton", "lora_dtype": "float16"}, "triton LoRA backend needs lora_dtype"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(str(base), device="cpu", dtype=kwargs.pop("dtype", "float32"), **kwargs)


@pytest.mark.parametrize("resident_first", [True, False])
def test_mixed_adapters_under_chunking_preemption_and_small_pool(adapters, resident_first):
    base, dirs, oracle = adapters["llama"]
    llm = _llm(
        base,
        num_kv_blocks=24,
        max_num_batched_tokens=9,
        max_loras=2,
        lora_pool_pages=3,  # one rank-32 adapter needs 2 pages per module: forces pool evictions
        lora_resident_first=resident_first,
        lora_max_bypass_steps=4,
    )
    _run_and_check(llm, dirs, oracle, _workload(dirs, seed=2, n=12))
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert llm.engine.get_lora_stats().evictions > 0


def test_repointed_name_serves_new_weights(adapters, tmp_path):
    base, dirs, oracle = adapters["llama"]
    llm = _llm(base)
    target = tmp_path / "support-bot"
    shutil.copytree(dirs["all7-r4"], target)
    prompt = list(range(3, 23))  # 5 full blocks: prefix caching would reuse them if keys collided
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    lr = LoRARequest("support-bot", str(target))
    first = llm.generate([prompt], params, lora_request=lr)[0].outputs[0].token_ids
    assert first == oracle.greedy(prompt, NEW, dirs["all7-r4"])
    shutil.rmtree(target)
    shutil.copytree(dirs["gud-r12"], target)
    second = llm.generate([prompt], params, lora_request=lr)[0].outputs[0].token_ids
    assert second == oracle.greedy(prompt, NEW, dirs["gud-r12"])
    assert first != second


def test_same_prompt_two_adapters_never_share_kv(adapters):
    base, dirs, oracle = adapters["llama"]
    llm = _llm(base)
    prompt = list(range(10, 34))
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    names = ["all7-r4", "qv-r8-rslora", None]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    for _ in range(2):  # the second round hits the prefix cache, each adapter its own blocks
        outs = llm.generate([prompt] * 3, params, lora_request=loras)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == [oracle.greedy(prompt, NEW, dirs[n] if n else None) for n in names]
        assert len({tuple(g) for g in got}) == 3
    assert llm.engine.get_stats().prefix_cache_hits > 0


def test_adapter_loads_in_background_without_stalling(adapters):
    base, dirs, oracle = adapters["llama"]
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    gate = threading.Event()
    eng.lora.loader._submit(gate.wait)  # hold the (single) loader thread so the load below cannot finish yet
    eng.add_request("base", [5, 6, 7], params)
    eng.add_request("tuned", [5, 6, 7], params, LoRARequest("gud", str(dirs["gud-r12"])))
    eng.step()
    eng.step()
    # The adapter is still loading: its request waits while the base request keeps stepping.
    assert [r.seq_id for r in eng.scheduler.running] == ["base"]
    assert [r.seq_id for r in eng.scheduler.waiting] == ["tuned"]
    gate.set()
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert done["tuned"].outputs[0].token_ids == oracle.greedy([5, 6, 7], NEW, dirs["gud-r12"])
    assert eng.get_lora_stats().loads == 1


def test_failed_background_load_ends_request_with_error(adapters, tmp_path):
    base, dirs, _ = adapters["llama"]
    bad = tmp_path / "bad"
    shutil.copytree(dirs["all7-r4"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4), LoRARequest("bad", str(bad)))
    outs = []
    deadline = time.monotonic() + 30
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        outs += eng.step()
        time.sleep(0.01)  # the load runs in a background thread; an idle engine just polls
    (out,) = outs
    assert out.finished and "DoRA" in out.error and out.outputs[0].finish_reason == "abort"
    assert eng.get_stats().kv_blocks_used == 0 and eng.get_lora_stats().pages_used == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["norm"]}, "modules_to_save"),
        ({"r": 64}, "rank"),
    ],
)
def test_refused_adapter_leaves_pool_unchanged(adapters, tmp_path, change, message):
    base, dirs, _ = adapters["llama"]
    llm = LLM(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    ok = LoRARequest("ok", str(dirs["all7-r4"]))
    llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora_request=ok)
    before = llm.engine.get_lora_stats()
    bad = tmp_path / "bad"
    shutil.copytree(dirs["gud-r12"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(AdapterError, match=message):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora_request=LoRARequest("bad", str(bad)))
    after = llm.engine.get_lora_stats()
    assert (after.pages_used, after.resident, after.cpu_cached) == (
        before.pages_used,
        before.resident,
        before.cpu_cached,
    )
    assert not llm.engine.has_unfinished_requests()


def test_lora_management_api(adapters):
    base, dirs, _ = adapters["llama"]
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    digest = eng.add_lora(LoRARequest("a", str(dirs["layer1-r32"])))
    (info,) = eng.list_loras()
    assert info.digest == digest and info.names == ["a"] and info.tier == "cpu" and info.rank == 32
    assert eng.pin_lora("a")
    (info,) = eng.list_loras()
    assert info.tier == "device" and info.pinned and info.pages == 4  # 2 pages each on v and up
    assert eng.get_lora_stats().pages_used == 4
    assert eng.remove_lora("a")
    assert eng.list_loras() == [] and eng.get_lora_stats().pages_used == 0


def test_lora_disabled_refuses_requests(checkpoint, adapters):
    base, dirs, _ = adapters["llama"]
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5]], SamplingParams(), lora_request=LoRARequest("a", str(dirs["all7-r4"])))


def test_given_digest_is_trusted_for_identity_and_checked_on_load(adapters):
    from engine.lora.adapter_checkpoint import adapter_digest

    base, dirs, oracle = adapters["llama"]
    llm = LLM(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    path = str(dirs["gud-r12"])
    good = LoRARequest("gud", path, adapter_digest(path))
    out = llm.generate([[5, 6, 7]], params, lora_request=good)[0].outputs[0].token_ids
    assert out == oracle.greedy([5, 6, 7], NEW, dirs["gud-r12"])
    assert [i.digest for i in llm.engine.list_loras()] == [good.digest]
    with pytest.raises(AdapterError, match="changed"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest("gud", path, "0" * 64))
    assert [i.digest for i in llm.engine.list_loras()] == [good.digest]  # the refused one left nothing


def test_prefetch_loads_in_background_then_serves_without_waiting(adapters):
    base, dirs, oracle = adapters["llama"]
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    lr = LoRARequest("pre", str(dirs["qv-r8-rslora"]))
    eng.prefetch_lora(lr)  # returns at once; the digest and weights are read by the loader thread
    deadline = time.monotonic() + 30
    while eng.get_lora_stats().loads < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.get_lora_stats().loads == 1
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    eng.add_request("r", [5, 6, 7], params, lr)
    eng.step()
    assert [r.seq_id for r in eng.scheduler.running] == ["r"]  # admitted in the first step
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert done["r"].outputs[0].token_ids == oracle.greedy([5, 6, 7], NEW, dirs["qv-r8-rslora"])
    assert eng.get_lora_stats().loads == 1


def test_adapter_removed_while_requests_wait(adapters, tmp_path):
    """`remove_lora` of an adapter that waiting requests use only retires it: they finish on the version
    they were admitted with, even when its files were replaced meanwhile, and then it is forgotten."""
    base, dirs, oracle = adapters["llama"]
    eng = LLMEngine.from_args(str(base), device="cpu", dtype="float32", max_lora_rank=32)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    same = LoRARequest("gud", str(dirs["gud-r12"]))
    eng.add_lora(same)
    eng.add_request("same", [5, 6, 7], params, same)
    assert eng.remove_lora("gud")
    target = tmp_path / "moved"
    shutil.copytree(dirs["all7-r4"], target)
    changed = LoRARequest("moved", str(target))
    eng.add_lora(changed)
    eng.add_request("changed", [5, 6, 7], params, changed)
    assert eng.remove_lora("moved")
    shutil.rmtree(target)
    shutil.copytree(dirs["qv-r8-rslora"], target)
    assert {i.names[0] for i in eng.list_loras()} == {"gud", "moved"}  # retired, not gone yet
    done = {}
    deadline = time.monotonic() + 60
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert done["same"].error is None and done["changed"].error is None
    assert done["same"].outputs[0].token_ids == oracle.greedy([5, 6, 7], NEW, dirs["gud-r12"])
    assert done["changed"].outputs[0].token_ids == oracle.greedy([5, 6, 7], NEW, dirs["all7-r4"])
    assert eng.list_loras() == [] and eng.get_lora_stats().pages_used == 0
    assert eng.get_stats().kv_blocks_used == 0
