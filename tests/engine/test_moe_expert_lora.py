"""LoRA on the routed experts of the four MoE families, in mixed batches, token-for-token equal to PEFT
(float32): PEFT's `target_parameters` on transformers 5's fused expert parameters alone; base rows with
three adapters of different ranks and targets (attention, experts, both) under chunked prefill and
preemption; adapters saved in the per-expert layout (`experts.N.gate_proj` ..., Mixtral's `w1/w3/w2`)
beside fused ones. The adapter pool reports each adapter's device memory, expert pages included.

(Attention-only adapters on MoE models and the refusals are in test_moe_lora.py.)"""

from __future__ import annotations

import random

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.expert_pages import EXPERT_PROJS
from engine.model.moe import SparseMoE
from engine.model_config import ModelConfig
from tests.helpers.expert_adapters import build_per_expert_adapter
from tests.helpers.graph_check import CheckedReplay, engine_tensors
from tests.helpers.peft_batch import check_requests, cpu_llm
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import MOE_ARCHS

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 6
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SPECS = {
    "experts-r4": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    "both-r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["k_proj", "o_proj"],
        target_parameters=EXPERTS,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"gate_up_proj": 48},
    ),
    "down-r2-rslora": dict(
        r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["down_proj"], use_rslora=True
    ),
}


class _TwinOracle:
    """PEFT on an adapter's fused twin where PEFT cannot read the adapter's own layout (Qwen2-MoE's
    per-expert adapters: `tests/helpers/expert_adapters.py`)."""

    def __init__(self, oracle: PeftGreedyOracle, twins: dict) -> None:
        self.oracle, self.twins = oracle, twins

    def greedy(self, prompt, new, adapter):
        return self.oracle.greedy(prompt, new, self.twins.get(adapter, adapter))


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Per MoE arch: (base dir, {name: adapter dir}, oracle); "per-expert" is in the per-expert layout."""
    out = {}
    for arch in MOE_ARCHS:
        base = checkpoint(arch)
        root = tmp_path_factory.mktemp(f"moe_expert_adapters_{arch}")
        dirs = {
            name: build_adapter(base, root / name, seed=i, **spec)
            for i, (name, spec) in enumerate(SPECS.items())
        }
        twin = root / "per-expert-twin" if arch == "qwen2_moe" else None
        dirs["per-expert"] = build_per_expert_adapter(
            base, root / "per-expert", r=4, lora_alpha=8, seed=9, twin=twin
        )
        oracle = PeftGreedyOracle(base)
        out[arch] = (base, dirs, _TwinOracle(oracle, {dirs["per-expert"]: twin}) if twin else oracle)
    return out


def _requests(seed: int, names: list[str | None], n: int) -> list[tuple[list[int], str | None]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 26))], names[i % len(names)]) for i in range(n)
    ]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_adapter_alone_matches_peft(arch, adapters):
    """Only the experts are adapted (`target_parameters`, no target_modules); the adapter changes the
    tokens, and the engine's are PEFT's."""
    base, dirs, oracle = adapters[arch]
    reqs = _requests(1, ["experts-r4"], 4)
    adapted = [oracle.greedy(p, NEW, dirs["experts-r4"]) for p, _ in reqs]
    assert adapted != [oracle.greedy(p, NEW, None) for p, _ in reqs]
    check_requests(cpu_llm(base), dirs, oracle, reqs, NEW)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_expert_and_attention_adapters_with_chunking_and_preemption(arch, adapters):
    """Base rows and three adapters (attention only, experts only, both with rank/alpha patterns) in one
    batch: once as is, once in chunks of 9 tokens with a KV cache small enough to preempt."""
    base, dirs, oracle = adapters[arch]
    names = ["attn-r8", "experts-r4", None, "both-r16"]
    check_requests(cpu_llm(base), dirs, oracle, _requests(2, names, 6), NEW)
    llm = cpu_llm(base, num_kv_blocks=14, max_num_batched_tokens=9, max_loras=3)
    check_requests(llm, dirs, oracle, _requests(3, [*names, "down-r2-rslora"], 8), NEW)
    assert llm.engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("native_pairs", [True, False])
def test_decode_pairs_native_and_torch_both_match_peft(native_pairs, adapters, monkeypatch):
    """Decode rows' expert LoRA on the op-by-op path (`ExpertLoRAStep.add_pairs`, which the fused decode
    call replaces on the CPU in float32, so it is turned off here) on the native pair kernel and on the
    torch path it replaces (gathered pages; CUDA's and other dtypes' path): both PEFT's."""
    import engine.lora.expert_step as expert_step
    import engine.model.moe_experts as moe_experts
    import kernels.moe_lora_pairs_cpu as pairs_kernel

    monkeypatch.setattr(moe_experts, "FUSED_LORA", False)
    monkeypatch.setattr(expert_step, "NATIVE_PAIRS", native_pairs)
    calls, kernel_calls = [], []
    real, real_kernel = expert_step.ExpertLoRAStep.add_pairs, pairs_kernel.lora_pairs_cpu
    monkeypatch.setattr(expert_step.ExpertLoRAStep, "add_pairs", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(pairs_kernel, "lora_pairs_cpu", lambda *a: kernel_calls.append(1) or real_kernel(*a))
    base, dirs, oracle = adapters["qwen3_moe"]
    check_requests(cpu_llm(base), dirs, oracle, _requests(4, ["experts-r4", "both-r16", None], 6), NEW)
    assert calls, "no decode pairs went through add_pairs"
    assert bool(kernel_calls) == native_pairs


def test_prefill_runs_are_batched_and_match_peft(adapters, monkeypatch):
    """A prefill's (expert, adapter) runs of several rows go through `ExpertLoRAStep.add_runs`, which
    multiplies each adapter's runs of similar length in padded `bmm`s, one pair per page: chunks of several
    runs occur, and the tokens are PEFT's (expert adapters with rank and alpha patterns, base rows)."""
    import engine.lora.expert_step as expert_step

    chunks: list[list] = []
    real = expert_step._run_chunks
    monkeypatch.setattr(expert_step, "_run_chunks", lambda runs: chunks.extend(c := real(runs)) or c)
    base, dirs, oracle = adapters["qwen3_moe"]
    rng = random.Random(5)
    names = ["experts-r4", "both-r16", None, "down-r2-rslora"]
    reqs = [([rng.randrange(3, 96) for _ in range(rng.randrange(40, 64))], names[i % 4]) for i in range(6)]
    check_requests(cpu_llm(base), dirs, oracle, reqs, NEW)
    assert any(len(c) > 1 for c in chunks), chunks


def test_run_chunks_cover_every_run_within_the_padding_bound():
    from engine.lora.expert_step import CHUNK_MAX_ROWS, CHUNK_PAD, _run_chunks

    rng = random.Random(0)
    runs = [(e, 100 * e, rng.randrange(1, 40)) for e in range(30)] + [(30, 5000, 900), (31, 6000, 700)]
    chunks = _run_chunks(runs)
    assert sorted(r for c in chunks for r in c) == sorted(runs)
    assert any(len(c) > 1 for c in chunks)
    for c in chunks:
        n_max = c[0][2]
        assert all(r[2] <= n_max for r in c)
        if len(c) > 1:
            assert len(c) * n_max <= min(CHUNK_PAD * sum(r[2] for r in c), CHUNK_MAX_ROWS)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_decode_call_applies_expert_lora(arch, adapters, monkeypatch):
    """The CPU's fused decode call (`kernels/moe_fused_cpu.py`) with each row's expert LoRA inside it:
    PEFT's tokens for base rows and adapters of one and two pages (rank 16 > page rank 8) and a down-only
    one in one batch; the call took the LoRA."""
    import kernels.moe_fused_cpu as fused_kernel

    real, calls = fused_kernel.fused_moe_cpu, []

    def counted(*args, lora=None, **kw):
        calls.append(lora is not None)
        return real(*args, lora=lora, **kw)

    monkeypatch.setattr(fused_kernel, "fused_moe_cpu", counted)
    base, dirs, oracle = adapters[arch]
    names = ["experts-r4", None, "both-r16", "down-r2-rslora"]
    check_requests(cpu_llm(base, lora_page_rank=8), dirs, oracle, _requests(8, names, 5), NEW)
    assert any(calls), "no fused call took expert LoRA"


def test_fused_decode_call_applies_bfloat16_expert_lora(adapters, monkeypatch):
    """A bfloat16 MoE model's expert LoRA inside the fused decode call (bfloat16 pages), for base rows and
    adapters of one and two pages and a down-only one: the call took the LoRA, the adapters change the
    tokens, and most requests' greedy tokens equal the op-by-op path's and PEFT's bfloat16 ones (bfloat16
    paths that sum or round in another order part at near-ties, the router's included)."""
    import torch

    import engine.model.moe_experts as moe_experts
    import kernels.moe_fused_cpu as fused_kernel

    real, calls = fused_kernel.fused_moe_cpu, []

    def counted(*args, lora=None, **kw):
        calls.append(lora is not None and args[0].dtype == torch.bfloat16)
        return real(*args, lora=lora, **kw)

    monkeypatch.setattr(fused_kernel, "fused_moe_cpu", counted)
    base, dirs, _ = adapters["qwen3_moe"]
    reqs = _requests(10, ["experts-r4", None, "both-r16", "down-r2-rslora"], 8)
    loras = [LoRARequest(n, str(dirs[n])) if n else None for _, n in reqs]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    tokens = {}
    for fused in (True, False):
        monkeypatch.setattr(moe_experts, "FUSED_LORA", fused)
        llm = cpu_llm(base, dtype="bfloat16", lora_page_rank=8)
        outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
        tokens[fused] = [o.outputs[0].token_ids for o in outs]
        if fused:
            assert any(calls), "no bfloat16 fused call took expert LoRA"
            plain = llm.generate([p for p, _ in reqs], params)  # the same prompts without adapters
            adapted = [i for i, (_, n) in enumerate(reqs) if n]
            assert any(tokens[True][i] != plain[i].outputs[0].token_ids for i in adapted)

    def agree(a: list, b: list) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    assert agree(tokens[True], tokens[False]) > len(reqs) // 2
    oracle = PeftGreedyOracle(base, dtype=torch.bfloat16)
    peft = [oracle.greedy(p, NEW, dirs[n] if n else None) for p, n in reqs]
    assert agree(tokens[True], peft) > len(reqs) // 2


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_per_expert_layout_adapter_matches_peft(arch, adapters):
    """An adapter saved with per-expert `target_modules` (gate, up and down of every expert, and q_proj)
    beside a fused `target_parameters` adapter and base rows, on a per-expert-layout checkpoint."""
    base, dirs, oracle = adapters[arch]
    check_requests(cpu_llm(base), dirs, oracle, _requests(4, ["per-expert", None, "both-r16"], 6), NEW)


def test_pool_reports_expert_adapter_memory(adapters):
    """`list_loras` counts a resident adapter's expert pages in its `memory_bytes`: per projection page,
    layers x experts x page_rank x (in + out) values; an attention adapter has none of them."""
    base, dirs, _ = adapters["qwen3_moe"]
    cfg = ModelConfig.from_dir(base)
    llm = cpu_llm(base)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for name in ("experts-r4", "attn-r8"):
        llm.generate([[5, 6, 7]], params, lora_request=LoRARequest(name, str(dirs[name])))
    infos = {i.names[0]: i for i in llm.engine.list_loras()}
    pool = llm.engine.lora.pool
    assert pool.experts is not None
    expert_bytes = sum(pool.experts.page_bytes(p) for p in EXPERT_PROJS)  # rank 4 <= page_rank: a page each
    attn = infos["attn-r8"].memory_bytes
    assert attn > 0 and infos["experts-r4"].memory_bytes == expert_bytes
    moe = cfg.extra["moe"]
    values = (
        cfg.num_layers
        * moe["num_experts"]
        * pool.page_rank
        * (2 * cfg.hidden_size + 3 * moe["intermediate_size"])
    )
    assert expert_bytes == values * 4  # float32
    assert infos["experts-r4"].rank == 4


def test_dense_model_refuses_target_parameters(checkpoint, tmp_path):
    """`target_parameters` on a model without experts is refused, naming the field."""
    from engine.lora.adapter_checkpoint import AdapterError, inspect_adapter

    base = checkpoint("llama")
    path = build_adapter(
        base, tmp_path / "p", r=2, target_modules=["v_proj"], target_parameters=["q_proj.weight"]
    )
    with pytest.raises(AdapterError, match=r"target_parameters: \['q_proj.weight'\]: LoRA on raw parameters"):
        inspect_adapter(path, ModelConfig.from_dir(base))
    llm = LLM(str(base), device="cpu", dtype="float32")
    with pytest.raises(AdapterError, match="target_parameters"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora_request=LoRARequest("p", str(path)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_lora_backends_apply_expert_lora(backend, adapters):
    """The torch CPU path and the CUDA path's Triton SGMV context (interpreted on the CPU) carry the
    step's expert LoRA as the native path does: PEFT's tokens for a mixed batch on Mixtral."""
    base, dirs, oracle = adapters["mixtral"]
    kw = {"lora_backend": backend} | ({"attention_backend": "triton"} if backend == "triton" else {})
    check_requests(cpu_llm(base, **kw), dirs, oracle, _requests(5, ["both-r16", None, "experts-r4"], 3), 3)


def test_prefix_cache_and_ngram_speculation_with_expert_adapters(adapters):
    """Repetitive prompts with a shared prefix on expert adapters and base rows, under n-gram speculation:
    prefix-cache hits, drafts verified (multi-row runs per request) through the experts' LoRA, and
    PEFT's tokens."""
    base, dirs, oracle = adapters["qwen3_moe"]
    rng = random.Random(6)
    shared = [rng.randrange(3, 96) for _ in range(9)]
    reqs = []
    for i, name in enumerate(["experts-r4", None, "both-r16", "experts-r4", None]):
        phrase = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 5))]
        reqs.append(((shared if i % 2 == 0 else []) + phrase * rng.randrange(2, 5), name))
    llm = cpu_llm(base, speculative="ngram", num_speculative_tokens=3)
    for _ in range(2):  # the second round reuses the first's cached blocks
        check_requests(llm, dirs, oracle, reqs, NEW)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_verifications > 0


def _on_kernel(monkeypatch) -> list[bool]:
    """Route every MoE block's experts to the Triton kernel (the dispatch picks it for CUDA tensors only);
    the list returned notes, per call, whether the step's expert LoRA adapted that block."""
    calls: list[bool] = []
    triton_experts = SparseMoE.triton_experts

    def counted(self, x, weights, ids, hook=None):
        calls.append(hook is not None and hook.adapts(self.layer))
        return triton_experts(self, x, weights, ids, hook)

    monkeypatch.setattr(SparseMoE, "uses_triton", lambda self, x: True)
    monkeypatch.setattr(SparseMoE, "triton_experts", counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_fused_moe_kernel_applies_expert_lora(arch, adapters, monkeypatch):
    """The CUDA path's Triton fused-MoE kernel (interpreted on the CPU) with the step's expert LoRA inside
    its grouped GEMMs: PEFT's tokens for base rows and adapters of ranks 4, 16 (two pages: rank 16 >
    page_rank 8, down at rank 2) and 2 (down only) in one batch, with chunked prefill; every MoE block ran
    on the kernel, with LoRA on it."""
    base, dirs, oracle = adapters[arch]
    calls = _on_kernel(monkeypatch)
    monkeypatch.setattr("engine.model.moe.experts_forward", None)  # the torch path is never taken
    llm = cpu_llm(base, lora_page_rank=8, max_num_batched_tokens=16)
    names = ["experts-r4", None, "both-r16", "down-r2-rslora"]
    check_requests(llm, dirs, oracle, _requests(7, names, 5), 4)
    assert calls and all(calls)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_decode_graphs_replay_moe_steps_and_leave_expert_lora_steps_eager(arch, adapters, monkeypatch):
    """Decode graphs on a MoE model with the routed experts on the CUDA path's Triton kernel (interpreted):
    every replay launches its capture's kernels, grids and scalars with every tensor from outside the pass
    at the same address (`CheckedReplay`: what a CUDA graph bakes in), and the tokens of base rows and
    attention adapters replayed, and of expert adapters run eagerly beside them, equal PEFT's. A step with
    an expert-LoRA row never replays (the graphs are captured without expert LoRA)."""
    from engine.decode_graphs import DecodeGraphs

    base, dirs, oracle = adapters[arch]
    expert_calls = _on_kernel(monkeypatch)
    replayed_expert_lora: list[bool] = []
    run = DecodeGraphs.run

    def checked_run(self, inp, lora):
        replayed_expert_lora.append(lora is not None and lora.experts is not None)
        return run(self, inp, lora)

    monkeypatch.setattr(DecodeGraphs, "run", checked_run)
    kw = dict(attention_backend="triton", lora_backend="triton", enable_prefix_caching=False)
    llm = cpu_llm(base, **kw)
    eng = llm.engine
    checked = CheckedReplay(engine_tensors(eng))
    eng.runner.use_decode_graphs(checked, eng.lora.pool, max_batch=4)
    check_requests(llm, dirs, oracle, _requests(11, [None, "attn-r8"], 3), NEW)
    assert checked.replays > 0 and "_fused_moe_kernel" in checked.kernels
    before = checked.replays
    check_requests(llm, dirs, oracle, _requests(12, ["experts-r4", None, "attn-r8", "both-r16"], 4), NEW)
    assert any(expert_calls)  # the expert adapters' steps ran, with LoRA on the kernel
    assert replayed_expert_lora and not any(replayed_expert_lora)
    assert checked.replays >= before and checked.launches_checked > 0
