"""Reference logits processing: HF transformers' logits processors where they match the definitions
loraplex implements (vLLM's), OpenAI's frequency/presence formula written out token by token."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from engine.sampling_noise import exponential_noise, position_key
from engine.sampling_params import SamplingParams


def openai_penalties(logits: torch.Tensor, output: list[int], freq: float, pres: float) -> torch.Tensor:
    """OpenAI's definition, token by token: logit -= count * frequency + [count > 0] * presence."""
    out = logits.clone()
    for tok in set(output):
        out[tok] -= output.count(tok) * freq + pres
    return out


def reference_logits(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], eos: Seq[int]
) -> torch.Tensor:
    """One row through HF's processors (the ones matching each definition), in vLLM's order."""
    row = logits.clone()[None]
    whole = torch.tensor([prompt + output])
    produced = torch.tensor([output], dtype=torch.long).reshape(1, -1)
    if p.bad_words_token_ids:  # matched against the output only (vLLM), so HF sees just the output
        row = NoBadWordsLogitsProcessor(p.bad_words_token_ids, eos_token_id=None)(produced, row)
    if p.min_tokens:
        masked = [*([] if p.ignore_eos else eos), *p.stop_token_ids]
        row = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, masked)(whole, row)
    if p.logit_bias:
        bias = {(t,): v for t, v in p.logit_bias.items()}
        row = SequenceBiasLogitsProcessor(bias)(whole, row)
    if p.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(whole, row)
    return openai_penalties(row[0], output, p.frequency_penalty, p.presence_penalty)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Processed logits -> the sampling distribution: temperature, then min_p (HF's warpers)."""
    row = TemperatureLogitsWarper(p.temperature)(None, logits.clone()[None])
    if p.min_p > 0:
        row = MinPLogitsWarper(p.min_p)(None, row)
    return row[0].softmax(-1)


def reference_decode(oracle, adapter_dir, prompt: list[int], p: SamplingParams, eos: Seq[int]) -> list[int]:
    """HF + PEFT (`oracle`: a `PeftGreedyOracle`), one token at a time: processors, then argmax (greedy)
    or argmax(probs / q) with q the Exp(1) noise of (seed, position), as the engine draws it
    (`engine/sampling_noise.py`; sampled cases are seeded)."""
    out: list[int] = []
    while len(out) < p.max_tokens:
        logits = oracle.logits(prompt + out, adapter_dir)[-1]
        row = reference_logits(logits, p, prompt, out, eos)
        if p.greedy:
            tok = int(row.argmax())
        else:
            assert p.seed is not None, "a sampled reference decode is seeded"
            q = exponential_noise(torch.tensor([position_key(p.seed, len(out))]), row.shape[-1])[0]
            tok = int((reference_probs(row, p) / q).argmax())
        out.append(tok)
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
            break
    return out
