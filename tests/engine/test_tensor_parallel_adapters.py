"""Every adapter kind under tensor parallel (gloo, two ranks): DoRA on attention and MLP (the row-parallel
o/down norms summed over the ranks), lora_bias (row-parallel bias once), embed_tokens + lm_head LoRA,
trainable tokens and modules_to_save (tied Qwen2: the embedding side on every rank, the head on rank 0)
and a weighted mix of members of different ranks, with base rows, in ONE batch: greedy tokens at TP=2
equal TP=1's and HF transformers + PEFT's (float32); every adapter dropped and reloaded (into other pool
slots) gives the same tokens; a restarted worker group gets every kind back. One TP=2 engine."""

from __future__ import annotations

import os
import signal

import pytest

from engine import LLM, SamplingParams
from tests.helpers.peft_batch import build_weighted_cat, lora_request
from tests.helpers.tiny_adapters import PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {
    "dora-all7-r4": dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True),
    "dora-odown-r8": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "down_proj"], use_dora=True, use_rslora=True
    ),
    "bias-r4": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"], lora_bias=True
    ),
    "embed-head-r8": dict(r=8, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "v_proj"]),
    "tokens-r2": dict(
        r=2, lora_alpha=4, target_modules=["o_proj"], trainable_token_indices=[5, 9, 17, 33, 60]
    ),
    "saved-r4": dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]
    ),
    "plain-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
}
MIXES = {"mix": [("plain-r4", 0.7), ("embed-head-r8", -0.4)]}  # ranks 4 and 8
NAMES = [*SPECS, "mix"]
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 6, 7, 33], [12, 13], [40, 41, 42, 43, 44, 45, 60], [7] * 9, [3, 90, 17, 60, 22]]


def engine(base, tp: int) -> LLM:
    """8 pool slots (8 pages per projection, one per adapter): after every adapter is dropped, the
    reloads take the freed slots again."""
    return LLM(
        str(base),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_lora_rank=16,
        max_loras=8,
        lora_pool_pages=8,
        max_num_batched_tokens=32,
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A Qwen2 (q/k/v bias, tied embeddings), the adapters, PEFT's cat adapter of the mix, the oracle and
    TP=2 / TP=1 engines."""
    root = tmp_path_factory.mktemp("tp-adapters")
    base = build_checkpoint(root / "base", "qwen2")
    dirs = {n: build_adapter(base, root / n, seed=40 + i, **s) for i, (n, s) in enumerate(SPECS.items())}
    dirs["mix"] = build_weighted_cat(base, dirs, MIXES["mix"], root / "cat-mix")
    tp2 = engine(base, 2)
    yield dirs, PeftGreedyOracle(base), tp2, engine(base, 1)
    tp2.engine.shutdown()


def batch(order: list[str]) -> list[tuple[list[int], str | None]]:
    """One request per adapter name of `order` (each with its own prompt) between two base rows."""
    reqs: list[tuple[list[int], str | None]] = [(PROMPTS[1], None)]
    reqs += [(PROMPTS[NAMES.index(n) % len(PROMPTS)], n) for n in order]
    return [*reqs, (PROMPTS[3], None)]


def run(llm: LLM, dirs, reqs) -> list[list[int]]:
    loras = [lora_request(n, dirs, MIXES) if n else None for _, n in reqs]
    outs = llm.generate([p for p, _ in reqs], GREEDY, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def expected(oracle, dirs, reqs) -> list[list[int]]:
    return [oracle.greedy(p, NEW, dirs[n] if n else None) for p, n in reqs]


def slots(llm: LLM) -> dict[str, int]:
    pool = llm.engine.lora.pool
    return {d: r.slot for d, r in pool.resident.items()}


def test_every_kind_in_one_batch_equals_tp1_and_peft(setup):
    dirs, oracle, tp2, tp1 = setup
    reqs = batch(NAMES)
    got = run(tp2, dirs, reqs)
    assert got == run(tp1, dirs, reqs)
    for (_, name), toks, want in zip(reqs, got, expected(oracle, dirs, reqs), strict=True):
        assert toks == want, name
    assert len(slots(tp2)) == len(SPECS)  # every adapter (mix members included) was resident at once


def test_dropped_and_reloaded_equal(setup):
    """Every adapter removed from every tier, then requested in the reverse order: reloaded from disk
    into slots other adapters held before (pool and epilogue slots) on both ranks, same tokens."""
    dirs, oracle, tp2, _ = setup
    reqs = batch(NAMES)
    first = run(tp2, dirs, reqs)
    before = slots(tp2)
    uploads = tp2.engine.get_lora_stats().device_uploads
    for name in SPECS:
        assert tp2.engine.remove_lora(name)
    assert not tp2.engine.lora.pool.resident
    again = batch(NAMES[::-1])
    got = run(tp2, dirs, again)
    assert tp2.engine.get_lora_stats().device_uploads >= uploads + len(SPECS)
    after = slots(tp2)
    assert any(s != before[d] and s in before.values() for d, s in after.items())  # slots swapped
    by_name = {n: t for (_, n), t in zip(reqs, first, strict=True)}
    for (_, name), toks in zip(again, got, strict=True):
        if name is not None:
            assert toks == by_name[name], name
    assert first == expected(oracle, dirs, reqs)


def test_restarted_group_gets_every_kind_back(setup):
    """Worker rank 1 killed while idle: the next batch ends with the retryable error, the group restarts
    with the pool's residents sent again (DoRA norms summed again), and the batch then equals PEFT."""
    dirs, oracle, tp2, _ = setup
    eng = tp2.engine
    restarts = eng.tp.group.restarts
    os.kill(eng.tp.group.worker_pids()[0], signal.SIGKILL)
    reqs = batch(NAMES)
    loras = [lora_request(n, dirs, MIXES) if n else None for _, n in reqs]
    outs = tp2.generate([p for p, _ in reqs], GREEDY, lora_request=loras)
    assert all(o.error and "retry" in o.error for o in outs)
    assert eng.tp.group.restarts == restarts + 1
    assert run(tp2, dirs, reqs) == expected(oracle, dirs, reqs)


def test_mix_of_a_mix_member_and_plain_rows_share_a_step(setup):
    """A mix and its own members as plain requests in one batch (the same slots at weight 1 and at the
    mix's weights): PEFT's tokens for each."""
    dirs, oracle, tp2, _ = setup
    reqs = [(PROMPTS[0], "mix"), (PROMPTS[1], "plain-r4"), (PROMPTS[2], "embed-head-r8"), (PROMPTS[3], "mix")]
    assert run(tp2, dirs, reqs) == expected(oracle, dirs, reqs)
