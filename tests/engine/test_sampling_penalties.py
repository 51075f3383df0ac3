"""Penalties, logit_bias, min_p, min_tokens and bad words end to end: one mixed-adapter batch whose rows
all ask for different things, against HF + PEFT decoding token by token through HF's logits processors
(greedy, and seeded sampling reproduced draw for draw); with speculative decoding; best_of."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.sampling_params import SamplingParamsError
from engine.sequence import Sequence
from engine.spec.verify import verify
from tests.engine.test_speculative_sampling import goodness_of_fit
from tests.helpers.hf_logits_reference import reference_decode, reference_logits, reference_probs
from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter

pytestmark = pytest.mark.slow  # the PEFT oracle on tiny models

NEW = 10
NAMES = ("all7-r4", "qv-r8-rslora")


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    """(base dir, {adapter name: dir}, PEFT oracle, engine with LoRA)."""
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("penalty_adapters")
    dirs = {n: build_adapter(base, root / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(NAMES)}
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, max_lora_rank=32, max_loras=2)
    return base, dirs, PeftGreedyOracle(base), llm


def _cases(baseline: list[list[int]], temperature: float, seed: int | None) -> list[SamplingParams]:
    """Per row a different mix, built from that row's unprocessed output so each one bites."""
    common = {"max_tokens": NEW, "temperature": temperature, "seed": seed, "ignore_eos": True}
    b = baseline
    return [
        SamplingParams(**common),
        SamplingParams(repetition_penalty=1.8, **common),
        SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, **common),
        SamplingParams(logit_bias={b[3][0]: -100.0, b[3][1]: 3.0}, **common),
        SamplingParams(min_tokens=6, stop_token_ids=[b[4][1]], **common),
        SamplingParams(bad_words_token_ids=[[b[5][0]], b[5][2:4]], **common),
        SamplingParams(repetition_penalty=0.7, presence_penalty=-1.0, min_p=0.2, **common),
        SamplingParams(frequency_penalty=0.8, logit_bias={b[7][2]: 2.5}, min_tokens=3, **common),
    ]


def _batch(setup, temperature: float, seed: int | None):
    _, dirs, oracle, llm = setup
    prompts = [[5 + 7 * i, 9, 11 + i, 40, 3 * i + 1][: 3 + i % 3] for i in range(8)]
    names = [NAMES[i % 2] if i % 3 else None for i in range(8)]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n in names]
    plain = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, lora_request=loras)]
    params = _cases(baseline, temperature, seed)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    eos = llm.engine.runner.sampler.eos_token_ids
    for i, (prompt, name, p) in enumerate(zip(prompts, names, params, strict=True)):
        expected = reference_decode(oracle, dirs[name] if name else None, prompt, p, eos)
        assert outs[i] == expected, f"row {i} ({name}): {p}"
    return baseline, outs


def test_greedy_mixed_adapter_batch_matches_hf_processors(setup):
    baseline, outs = _batch(setup, 0.0, None)
    assert outs[0] == baseline[0]
    changed = sum(o != b for o, b in zip(outs[1:], baseline[1:], strict=True))
    assert changed >= 6, "the processing should change most rows' greedy output"
    assert len(outs[4]) >= 6  # its stop token was masked until min_tokens


def test_seeded_sampling_mixed_adapter_batch_matches_hf_processors(setup):
    _batch(setup, 0.9, 1234)


def test_speculative_decoding_keeps_processed_rows_exact(setup):
    base = setup[0]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 96) for _ in range(3)] * 4 for _ in range(6)]  # n-gram lookups match
    common = {"max_tokens": 14, "temperature": 0.0, "ignore_eos": True}
    processed = [
        SamplingParams(repetition_penalty=1.4, **common),
        SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, **common),
        SamplingParams(logit_bias={p[0]: -100.0 for p in prompts}, **common),
    ]
    params = [processed[i % 3] for i in range(6)] + [SamplingParams(**common)] * 6
    plain = LLM(str(base), device="cpu", dtype="float32", block_size=4)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts * 2, params)]
    assert want[:6] != want[6:], "the processing should change the output"
    for batch in (slice(0, 6), slice(0, 12)):  # processed rows alone, then mixed with plain ones
        spec = LLM(str(base), device="cpu", dtype="float32", block_size=4, speculative="ngram")
        assert spec.engine.spec is not None
        spec.engine.spec.cost.fixed_theta = 0.05  # speculate whatever this machine's timings
        got = [o.outputs[0].token_ids for o in spec.generate((prompts * 2)[batch], params[batch])]
        assert got == want[batch]
        stats = spec.engine.get_stats()
        assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens  # accepted and rolled back


def test_verification_samples_the_processed_distribution():
    """`verify` alone on fixed logits, a sequence with history under penalties, logit_bias, min_p and
    min_tokens: the first emitted token follows the processed p_0 and the second (after accepting d_1)
    the processed p_1, whose history includes d_1 (goodness of fit, as in test_speculative_sampling)."""
    vocab = 8
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.2
    params = SamplingParams(
        temperature=0.8,
        max_tokens=8,
        repetition_penalty=1.5,
        presence_penalty=0.6,
        frequency_penalty=0.3,
        logit_bias={1: 1.0},
        min_p=0.05,
        min_tokens=3,
        stop_token_ids=[6],
    )
    prompt, output = [3, 4], [5]
    ref = [reference_logits(logits[0], params, prompt, output, ())]
    d1 = int(reference_probs(ref[0], params).argsort(descending=True)[1])
    ref.append(reference_logits(logits[1], params, prompt, [*output, d1], ()))
    p = [reference_probs(r, params) for r in ref]
    d2 = int(p[1].argmax())
    gen = torch.Generator().manual_seed(1)
    first, second = Counter(), Counter()
    for _ in range(6):
        seqs = []
        for i in range(2000):
            s = Sequence(f"s{i}", prompt, params, 0.0)
            s.append_token(output[0])
            seqs.append(s)
        for toks in verify(logits.repeat(2000, 1), seqs, [[d1, d2]] * 2000, gen):
            ids = [t.token_id for t in toks]
            first[ids[0]] += 1
            if ids[0] == d1:
                second[ids[1]] += 1
    assert 6 not in first and 6 not in second  # stop token masked under min_tokens
    assert goodness_of_fit(first, p[0]) > 1e-3
    assert goodness_of_fit(second, p[1]) > 1e-3


def test_best_of_returns_the_highest_cumulative_logprob(setup):
    _, _, _, llm = setup
    prompt = [5, 9, 11, 40]
    common = {"max_tokens": 6, "temperature": 1.0, "seed": 77, "ignore_eos": True}
    every = llm.generate([prompt], SamplingParams(n=4, logprobs=0, **common))[0].outputs
    best = llm.generate([prompt], SamplingParams(n=2, best_of=4, **common))[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert len({tuple(c.token_ids) for c in every}) > 1


def test_bad_words_are_tokenized_and_never_generated(checkpoint):
    llm = LLM(str(checkpoint("llama", tokenizer=True, vocab_size=100)), device="cpu", dtype="float32")
    base = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    word = base.outputs[0].text.strip()[:1]
    assert word
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, bad_words=[word])
    out = llm.generate(["abc"], params)[0].outputs[0]
    assert word not in out.text
    banned = llm.engine.tokenizer.encode(word, add_special_tokens=False)
    assert banned and banned[-1] not in out.token_ids


def test_token_ids_outside_the_vocabulary_are_refused(setup):
    llm = setup[3]
    vocab = llm.engine.model_config.vocab_size
    for kwargs, field in [
        ({"logit_bias": {vocab: 1.0}}, "logit_bias"),
        ({"bad_words_token_ids": [[1, vocab]]}, "bad_words_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),  # this checkpoint has no tokenizer
    ]:
        with pytest.raises(SamplingParamsError) as err:
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, **kwargs))
        assert err.value.field == field


def test_penalties_under_a_grammar_match_masked_hf_reference(checkpoint):
    """Regex `[a-d]{8}` (each char one token of the char tokenizer): per step only a..d are allowed, so
    the reference is HF's processors on the grammar-masked logits; the output still matches the grammar."""
    from engine.structured import StructuredSpec
    from tests.helpers.tiny_models import HFGreedyOracle

    ckpt = checkpoint("llama", tokenizer=True, vocab_size=100)
    llm = LLM(str(ckpt), device="cpu", dtype="float32")
    tok = llm.engine.tokenizer
    allowed = [tok.convert_tokens_to_ids(c) for c in "abcd"]
    prompt = tok.encode("hello")
    spec = StructuredSpec("regex", "[a-d]{8}")
    common = {"max_tokens": 12, "temperature": 0.0, "structured": spec}
    plain = llm.generate([prompt], SamplingParams(**common))[0].outputs[0]
    params = SamplingParams(
        repetition_penalty=3.0, frequency_penalty=1.0, logit_bias={allowed[0]: 0.5}, **common
    )
    out = llm.generate([prompt], params)[0].outputs[0]
    assert re.fullmatch("[a-d]{8}", out.text) and out.text != plain.text
    hf = HFGreedyOracle(ckpt)
    ids: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = hf.model(torch.tensor([prompt + ids])).logits[0, -1]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        ids.append(int(reference_logits(masked, params, prompt, ids, ()).argmax()))
    assert out.token_ids[:8] == ids


def test_stop_strings_wait_for_min_tokens(checkpoint):
    """vLLM's rule: a stop string in the text of the first `min_tokens` tokens does not end the output
    (char tokenizer: token i is character i)."""
    llm = LLM(str(checkpoint("llama", tokenizer=True, vocab_size=100)), device="cpu", dtype="float32")
    common = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    text = llm.generate(["abc"], SamplingParams(**common))[0].outputs[0].text
    stop = text[1]
    early = llm.generate(["abc"], SamplingParams(stop=[stop], **common))[0].outputs[0].text
    assert early == text[: text.index(stop)]
    late = llm.generate(["abc"], SamplingParams(stop=[stop], min_tokens=5, **common))[0].outputs[0]
    cut = text.find(stop, 5)
    assert late.text == (text[:cut] if cut >= 0 else text)
    assert len(late.text) >= 5
