"""Mixture-of-experts models on two ranks (gloo, CPU): tensor parallel (each expert's intermediate rows
split) and expert parallel (`enable_expert_parallel`, each rank its experts whole, `linear` and
`round_robin` placement). Greedy tokens equal TP=1's and HF transformers + PEFT's (float32) for
Qwen3-MoE (fused expert checkpoint), Qwen2-MoE (gated shared expert, a dense layer), Mixtral and OLMoE
(q/k norms over whole rows, its one KV head replicated on both ranks), with base rows and attention,
fused-expert (`target_parameters`) and per-expert (`target_modules`) adapters in one batch under chunked
prefill; four adapters cycled through a pool of three and a host cache of two give the same tokens after
each eviction and reload, and after a killed worker's restart; each rank holds its share of the expert
weights and adapter expert pages; bad sizes are one-line errors at start. One two-rank engine per
(family, mode), shared by the module's tests."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.distributed.moe_shard import expert_bytes_per_rank
from engine.llm_engine import LLMEngine
from engine.lora.expert_pages import EXPERT_PROJS
from engine.model.moe import Experts
from engine.model_config import ModelConfig
from tests.helpers.expert_adapters import build_per_expert_adapter
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

pytestmark = pytest.mark.slow  # two-rank engines and the PEFT oracle

NEW = 5
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SPECS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "experts-r4": dict(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=EXPERTS),
    "down-r2": dict(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["down_proj"]),
}
MIXED = ["attn-r8", None, "experts-r4", "per-expert"]  # one step: base rows and three adapter kinds
# (family, mode): every family at TP=2; Qwen3-MoE, Qwen2-MoE and Mixtral under both placements too
CASES = [
    ("qwen3_moe", "tp"),
    ("qwen3_moe", "linear"),
    ("qwen3_moe", "round_robin"),
    ("qwen2_moe", "tp"),
    ("qwen2_moe", "linear"),
    ("qwen2_moe", "round_robin"),
    ("mixtral", "tp"),
    ("mixtral", "linear"),
    ("mixtral", "round_robin"),
    ("olmoe", "tp"),
]


def engine_kwargs(**kw) -> dict:
    """float32 CPU, blocks of 4, a 12-token step budget (prompts prefill in chunks), a pool of three
    rank-16 adapters and a host cache of two."""
    base = dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=16, max_loras=3)
    base |= dict(lora_pool_pages=3, max_cpu_loras=2, max_num_batched_tokens=12)
    return base | kw


class Family:
    """A tiny checkpoint of one family, its adapters, the PEFT oracle and TP=1's tokens (memoized)."""

    def __init__(self, arch: str, root) -> None:
        self.arch = arch
        # OLMoE with one KV head: its whole-row k norm over a KV head replicated on both ranks
        extra = dict(num_key_value_heads=1) if arch == "olmoe" else {}
        self.base = build_checkpoint(root / "base", arch, fused_experts=arch == "qwen3_moe", **extra)
        self.dirs = {
            n: build_adapter(self.base, root / n, seed=i, **s) for i, (n, s) in enumerate(SPECS.items())
        }
        twin = root / "per-expert-twin" if arch == "qwen2_moe" else None
        self.dirs["per-expert"] = build_per_expert_adapter(
            self.base, root / "per-expert", r=4, lora_alpha=8, seed=9, twin=twin
        )
        self.twins = {self.dirs["per-expert"]: twin} if twin else {}
        self.oracle = PeftGreedyOracle(self.base)
        self._tp1: LLM | None = None
        self._greedy: dict[tuple, list[int]] = {}

    def greedy(self, prompt: tuple[int, ...], name: str | None) -> list[int]:
        """PEFT's greedy tokens (Qwen2-MoE's per-expert adapter: its fused twin, which PEFT reads)."""
        if (prompt, name) not in self._greedy:
            d = self.dirs[name] if name else None
            self._greedy[prompt, name] = self.oracle.greedy(list(prompt), NEW, self.twins.get(d, d))
        return self._greedy[prompt, name]

    def tp1(self) -> LLM:
        if self._tp1 is None:
            self._tp1 = LLM(str(self.base), **engine_kwargs())
        return self._tp1

    def lora(self, name: str | None) -> LoRARequest | None:
        return LoRARequest(name, str(self.dirs[name])) if name else None


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    made: dict[str, Family] = {}

    def get(arch: str) -> Family:
        if arch not in made:
            made[arch] = Family(arch, tmp_path_factory.mktemp(f"tp-moe-{arch}"))
        return made[arch]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{m}" for a, m in CASES])
def case(request, families):
    """(family, mode, its two-rank engine); the engine's worker stops afterwards."""
    arch, mode = request.param
    fam = families(arch)
    ep = {} if mode == "tp" else dict(enable_expert_parallel=True, expert_placement=mode)
    llm = LLM(str(fam.base), **engine_kwargs(tensor_parallel_size=2, **ep))
    yield fam, mode, llm
    llm.engine.shutdown()


def requests(seed: int, names: list, n: int) -> list[tuple[list[int], str | None]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 20))], names[i % len(names)]) for i in range(n)
    ]


def generate(llm: LLM, fam: Family, reqs) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in reqs], params, lora_request=[fam.lora(n) for _, n in reqs])
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_adapters_equal_tp1_and_peft(case):
    """Base rows, an attention adapter, a fused-expert adapter and a per-expert adapter in one batch,
    prefilled in chunks: the two ranks give TP=1's tokens, which are PEFT's."""
    fam, _, llm = case
    reqs = requests(0, MIXED, 6)
    got = generate(llm, fam, reqs)
    assert got == generate(fam.tp1(), fam, reqs)
    for (prompt, name), toks in zip(reqs, got, strict=True):
        assert toks == fam.greedy(tuple(prompt), name), name
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_eviction_reload_equal(case):
    """Four adapters (expert ones included) through a pool of three and a host cache of two, twice: each
    reload (every rank cutting its part of the same digest into the same slot) gives PEFT's tokens."""
    fam, _, llm = case
    prompt = [7, 8, 9, 10, 11, 12]
    names = ["experts-r4", "down-r2", "per-expert", "attn-r8"]
    before = llm.engine.get_lora_stats().evictions
    for _ in range(2):
        for name in names:
            assert generate(llm, fam, [(prompt, name)]) == [fam.greedy(tuple(prompt), name)], name
    assert llm.engine.get_lora_stats().evictions >= before + 4


def test_memory_per_rank(case):
    """Rank 0 holds half the expert weights (tensor parallel: half of every expert's rows; expert
    parallel: half the experts), and an expert adapter's pages on it are its share of the whole."""
    fam, mode, llm = case
    cfg = ModelConfig.from_dir(fam.base)
    moe = cfg.extra["moe"]
    layers = sum(isinstance(m, Experts) for m in llm.engine.model.modules())
    e, h, i = int(moe["num_experts"]), cfg.hidden_size, int(moe["intermediate_size"])
    assert expert_bytes_per_rank(llm.engine.model) == layers * e * 3 * h * i * 4 // 2  # float32
    generate(llm, fam, [([5, 6, 7], "experts-r4")])
    info = next(x for x in llm.engine.list_loras() if "experts-r4" in x.names)
    pool = llm.engine.lora.pool
    pr, n = pool.page_rank, cfg.num_layers
    if mode == "tp":  # every expert, half its intermediate width
        want = n * e * pr * ((h + i) + (i // 2 + h)) * 4
    else:  # half the experts, whole
        want = n * (e // 2) * pr * ((h + 2 * i) + (i + h)) * 4
    assert sum(pool.experts.page_bytes(p) for p in EXPERT_PROJS) == want
    assert info.memory_bytes >= want


@pytest.mark.parametrize(
    ("kwargs", "width", "message"),
    [
        (dict(enable_expert_parallel=True), 32, "does not divide the model's 3 experts"),
        ({}, 31, r"does not divide the experts' intermediate size \(moe_intermediate_size\) 31"),
    ],
    ids=["experts", "width"],
)
def test_bad_moe_sizes_are_one_line_errors(tmp_path, kwargs, width, message):
    """3 experts over 2 ranks under expert parallel, experts 31 wide under tensor parallel: refused at
    start (before any worker starts) in one line."""
    base = build_checkpoint(tmp_path / "m", "qwen3_moe", num_experts=3, moe_intermediate_size=width)
    with pytest.raises(ValueError, match=message) as err:
        LLMEngine.from_args(str(base), device="cpu", tensor_parallel_size=2, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_local_experts_partition_and_their_partial_sums(placement):
    """Each placement gives every expert to exactly one rank, and the ranks' `experts_forward` partial
    sums (other ranks' pairs dropped, with expert LoRA runs on them) add up to the whole layer's."""
    from engine.distributed.moe_shard import local_experts
    from engine.model.moe_experts import experts_forward

    owners = [local_experts(8, 2, r, placement) for r in range(2)]
    assert sorted(owners[0] + owners[1]) == list(range(8)) and owners[0] != owners[1]
    assert owners[0] == ([0, 1, 2, 3] if placement == "linear" else [0, 2, 4, 6])
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(8, 16, 16, generator=gen), torch.randn(8, 16, 8, generator=gen)
    x, ids = torch.randn(5, 16, generator=gen), torch.randint(0, 8, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    whole = experts_forward(gate_up, down, x, weights, ids)
    parts = torch.zeros_like(whole)
    for local in owners:
        to_local = torch.full((8,), len(local), dtype=torch.long)
        to_local[local] = torch.arange(len(local))
        parts += experts_forward(gate_up[local], down[local], x, weights, to_local[ids])
    torch.testing.assert_close(parts, whole)


def test_upload_frame_carries_expert_lora(families):
    """The pool journal's upload frame round-trips an adapter's expert A/B (the workers cut their part)."""
    from engine.distributed import step_plan as sp
    from engine.lora.adapter_checkpoint import inspect_adapter

    fam = families("mixtral")
    ckpt = inspect_adapter(fam.dirs["experts-r4"], ModelConfig.from_dir(fam.base), 16)
    kind, arrays = sp.decode(sp.encode_upload(ckpt, 2, [[1], [], [], [0], [], [], []]))
    got, slot, _ = sp.decode_upload(arrays)
    assert kind == sp.UPLOAD and slot == 2 and len(got.experts) == len(ckpt.experts) > 0
    for w, g in zip(ckpt.experts, got.experts, strict=True):
        assert (g.layer, g.proj, g.rank, g.scaling) == (w.layer, w.proj, w.rank, w.scaling)
        assert torch.equal(g.lora_a, w.lora_a.float()) and torch.equal(g.lora_b, w.lora_b.float())


def test_worker_killed_group_restarts_with_expert_pages(case):
    """(Mixtral, expert parallel) A worker killed while expert adapters are resident: the request in
    flight ends with the retryable error, the restarted worker gets the pool's residents again (their
    expert pages included: the journal's frames), and the next requests give PEFT's tokens."""
    import os
    import signal

    fam, mode, llm = case
    if (fam.arch, mode) != ("mixtral", "linear"):
        pytest.skip("one case: group restarts are slow")
    eng = llm.engine
    generate(llm, fam, [([5, 6, 7], "experts-r4")])  # resident before the fault
    restarts = eng.tp.group.restarts
    os.kill(eng.tp.group.worker_pids()[0], signal.SIGKILL)
    eng.add_request("x", [3, 4, 5], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    ended = []
    while eng.has_unfinished_requests():
        ended += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in ended] == ["x"] and ended[0].error and "retry" in ended[0].error
    assert eng.tp.group.restarts == restarts + 1
    reqs = requests(7, ["experts-r4", "per-expert", None], 3)
    for (prompt, name), toks in zip(reqs, generate(llm, fam, reqs), strict=True):
        assert toks == fam.greedy(tuple(prompt), name), name
