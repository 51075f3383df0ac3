"""The token-level parts of a request's `SamplingParams` that need the model: `bad_words` tokenized,
and every token id the params name (`logit_bias`, bad-word sequences) checked against
the vocabulary."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams, SamplingParamsError


def bad_word_sequences(tokenizer: Any, word: str) -> list[list[int]]:
    """The token sequences that spell `word`: as the text starts with it, and, when different, after a
    space (mid-text), so the word is banned in both places (vLLM's reading of `bad_words`)."""
    bare = word.lstrip()
    out = [list(tokenizer.encode(bare, add_special_tokens=False))]
    spaced = list(tokenizer.encode(" " + bare, add_special_tokens=False))
    if spaced and spaced != out[0]:
        out.append(spaced)
    return [s for s in out if s]


def resolve_request_tokens(params: SamplingParams, tokenizer: Any, vocab_size: int) -> SamplingParams:
    """`params` validated, with `bad_words` turned into `bad_words_token_ids` (appended to any given);
    `SamplingParamsError` naming the field for a token id outside [0, vocab_size), bad words without a
    tokenizer, or a bad word longer than a banned sequence may be."""
    params.validate()
    if params.bad_words:
        if tokenizer is None:
            raise SamplingParamsError("bad_words", "this model has no tokenizer; use bad_words_token_ids")
        seqs = list(params.bad_words_token_ids)
        for i, word in enumerate(params.bad_words):
            found = bad_word_sequences(tokenizer, word)
            if any(len(s) > MAX_BAD_WORD_TOKENS for s in found):
                raise SamplingParamsError(
                    "bad_words", f"bad_words[{i}] is more than {MAX_BAD_WORD_TOKENS} tokens"
                )
            seqs.extend(s for s in found if s not in seqs)
        params = msgspec.structs.replace(params, bad_words=[], bad_words_token_ids=seqs)
        params.validate()  # the sequences' count and lengths
    _check_vocab("logit_bias", list(params.logit_bias or ()), vocab_size)
    _check_vocab("bad_words_token_ids", [t for s in params.bad_words_token_ids for t in s], vocab_size)
    return params


def _check_vocab(field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise SamplingParamsError(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
