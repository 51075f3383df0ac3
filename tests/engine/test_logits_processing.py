"""Logits processing (penalties, logit_bias, min_p, min_tokens, bad words) against HF's logits processors,
row by row, on one batch whose rows all ask for different things."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper

from engine.logits_processing import apply_min_p, process_logits
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.sequence import Sequence
from tests.helpers.hf_logits_reference import reference_logits

VOCAB = 50
EOS = (2, 7)


def _seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    s = Sequence("r", prompt, params, 0.0)
    for t in output:
        s.append_token(t)
    return s


def _reference(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    return reference_logits(logits, s.params, s.prompt_token_ids, s.output_token_ids, EOS)


def _batch(rng: random.Random) -> list[Sequence]:
    """Rows with different (and no) processing, prompts and outputs with repeats."""
    configs = [
        {},
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6, "frequency_penalty": 0.4},
        {"presence_penalty": 1.5, "frequency_penalty": -0.7},
        {"logit_bias": {3: 5.0, 11: -100.0, 49: 0.25}},
        {"min_tokens": 6, "stop_token_ids": [13]},
        {"min_tokens": 2},  # already past it: nothing masked
        {"bad_words_token_ids": [[4], [8, 9], [1, 2, 3]]},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5, "logit_bias": {5: 2.0}, "min_tokens": 9},
    ]
    seqs = []
    for cfg in configs:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        output = [rng.choice([8, 9, 1, 2, rng.randrange(VOCAB)]) for _ in range(rng.randrange(0, 6))]
        if "bad_words_token_ids" in cfg:
            output = [*output, 1, 2, 8]  # ends with the prefix of [8, 9] (and of [1, 2, 3] one step back)
        seqs.append(_seq(SamplingParams(max_tokens=32, **cfg), prompt, output))
    return seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_matches_hf_processors_row_by_row(seed):
    rng = random.Random(seed)
    seqs = _batch(rng)
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    out = process_logits(logits, seqs, EOS)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i], _reference(logits[i], s), msg=f"row {i}: {s.params}")
    assert torch.equal(out[0], logits[0])  # an unprocessed row is untouched
    bad = seqs[7]
    assert out[7, 4] == float("-inf") and out[7, 9] == float("-inf")
    assert bad.output_token_ids[-1] == 8


def test_in_place_processing_equals_the_copy():
    seqs = _batch(random.Random(5))
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(5))
    copy = process_logits(logits, seqs, EOS)
    same = logits.clone()
    assert process_logits(same, seqs, EOS, in_place=True) is same
    assert torch.equal(same, copy) and not torch.equal(logits, copy)


def test_rows_without_processing_cost_nothing():
    seqs = [_seq(SamplingParams(), [1, 2], [3]), _seq(SamplingParams(temperature=0), [4], [])]
    logits = torch.randn(2, VOCAB)
    assert process_logits(logits, seqs, EOS) is logits


def test_a_row_left_with_nothing_keeps_its_logits():
    # min_tokens masks EOS; a grammar mask upstream allowed only EOS: the row stays as it came.
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, EOS[0]] = 1.0
    seqs = [_seq(SamplingParams(min_tokens=3), [1], [])]
    assert torch.equal(process_logits(logits, seqs, EOS), logits)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_matches_hf(min_p):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    scaled = TemperatureLogitsWarper(0.7)(None, logits.clone())
    ours = apply_min_p(logits / 0.7, [min_p, 0.0, min_p, min_p])
    hf = MinPLogitsWarper(min_p)(None, scaled.clone())
    for row in (0, 2, 3):
        assert torch.equal(torch.isneginf(ours[row]), torch.isneginf(hf[row]))
    assert not torch.isneginf(ours[1]).any()  # min_p = 0: untouched


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -3}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("min_p", {"min_p": 1.5}),
        ("min_tokens", {"min_tokens": 17, "max_tokens": 16}),
        ("best_of", {"best_of": 2, "n": 3}),
        ("logit_bias", {"logit_bias": {1: 101.0}}),
        ("logit_bias", {"logit_bias": {i: 1.0 for i in range(1025)}}),
        ("bad_words", {"bad_words": [" "]}),
        ("bad_words_token_ids", {"bad_words_token_ids": [[]]}),
    ],
)
def test_out_of_range_is_refused_naming_the_field(field, kwargs):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
