"""`fully_sharded_loras` at TP=2 (gloo, two ranks on the CPU): column-parallel LoRA A split by rank, one
all-gather of the shrink output per packed projection. Greedy tokens equal TP=1 and HF + PEFT (float32)
for base rows and adapters of ranks 1, 4, 5 (odd: its rank-rows split 4 + 1 over the ranks of a page of
8) and 16 with rank_pattern, a DoRA adapter and a weighted mix (one all-gather per mix pass) in one
batch, prefilled in chunks. One TP=2 engine shared by the module."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.lora.pool import MODULE_INDEX
from tests.helpers.peft_batch import build_weighted_cat, lora_request
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

SPECS = {
    "all7-r4": ADAPTER_SPECS["all7-r4"],
    "pattern-r16": ADAPTER_SPECS["pattern-r16"],
    "mlp-regex-r1": ADAPTER_SPECS["mlp-regex-r1"],
    "odd-r5": dict(r=5, lora_alpha=10, target_modules=["q_proj", "v_proj", "up_proj", "o_proj"]),
    "dora-r4": dict(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True),
}
MIXES = {"mix": [("all7-r4", 0.6), ("odd-r5", -0.5)]}
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def engine_kwargs(tp: int) -> dict:
    return dict(device="cpu", dtype="float32", block_size=4, max_lora_rank=16, max_loras=6) | dict(
        lora_page_rank=8, max_num_batched_tokens=24, tensor_parallel_size=tp, fully_sharded_loras=True
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-fsl")
    base = build_checkpoint(root / "base", "llama")
    dirs = {
        name: build_adapter(base, root / name, seed=i, **spec) for i, (name, spec) in enumerate(SPECS.items())
    }
    dirs["mix"] = build_weighted_cat(base, dirs, MIXES["mix"], root / "cat-mix")
    tp2 = LLM(str(base), **engine_kwargs(2))
    yield base, dirs, PeftGreedyOracle(base), tp2
    tp2.engine.shutdown()


def requests(seed: int, n: int) -> list[tuple[list[int], str | None]]:
    rng = random.Random(seed)
    names = [*SPECS, "mix", None]
    return [
        ([rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))], names[i % len(names)]) for i in range(n)
    ]


def generate(llm: LLM, dirs, reqs):
    loras = [lora_request(name, dirs, MIXES) if name else None for _, name in reqs]
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in reqs], GREEDY, lora_request=loras)]


def test_fully_sharded_mixed_batch_equals_tp1_and_peft(setup):
    """Fourteen requests over five adapters, a mix and the base model in one batch: TP=2 fully sharded
    == TP=1 == PEFT, and rank 0's pool holds half of each column-parallel A page."""
    base, dirs, oracle, tp2 = setup
    reqs = requests(0, 14)
    got = generate(tp2, dirs, reqs)
    tp1 = LLM(str(base), **engine_kwargs(1))
    assert generate(tp1, dirs, reqs) == got
    for (prompt, name), tokens in zip(reqs, got, strict=True):
        assert tokens == oracle.greedy(prompt, NEW, dirs[name] if name else None), name
    pool = tp2.engine.lora.pool
    assert pool.a[MODULE_INDEX["q_proj"]].shape[2] == 4 and pool.a[MODULE_INDEX["o_proj"]].shape[2] == 8
    assert tp2.engine.tp.group.collective_calls > 0


def test_page_rank_must_split(setup):
    """A page rank the ranks cannot share evenly is a one-line error at start."""
    with pytest.raises(ValueError, match="lora_page_rank 3 must be divisible") as err:
        LLMEngine.from_args(
            str(setup[0]), device="cpu", tensor_parallel_size=2, fully_sharded_loras=True, lora_page_rank=3
        )
    assert "\n" not in str(err.value)
