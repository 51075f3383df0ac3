"""The one output path: stop strings with hold-back, and logprob tokens' own bytes for partial UTF-8."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.output_processor import SequenceText, held_back
from engine.tokenizer import token_bytes, token_text


@pytest.fixture(scope="module")
def byte_level():
    """A GPT-2-style byte-level tokenizer with no merges: every byte is one token, so a CJK character or
    an emoji spans several tokens, none of which is valid UTF-8 alone."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("text", ["你好", "ok 🙂!", "naïve"])
def test_token_bytes_are_the_tokens_own_bytes(byte_level, text):
    ids = byte_level.encode(text)
    raw = [token_bytes(byte_level, i) for i in ids]
    assert b"".join(raw) == text.encode()
    assert all(len(r) == 1 for r in raw)
    assert all("\ufffd" not in token_text(r) for r in raw)


def test_stream_holds_back_possible_stop_prefix(byte_level):
    seq = SequenceText(byte_level, ["STOP"])
    released = ""
    for tok in byte_level.encode("abcST"):
        assert seq.push(tok) is None
        released += seq.releasable(finished=False)
    assert released == "abc"  # "ST" may still become "STOP"
    for tok in byte_level.encode("OPxyz"):
        seq.push(tok)
    assert seq.stop_hit == "STOP" and seq.text == "abcST"[:3]
    assert released + seq.releasable(finished=True) == "abc"


def test_partial_characters_are_not_released(byte_level):
    seq = SequenceText(byte_level, [])
    ids = byte_level.encode("你")
    for tok in ids[:-1]:
        seq.push(tok)
        assert seq.releasable(finished=False) == ""
    seq.push(ids[-1])
    assert seq.releasable(finished=False) == "你"


def test_held_back_is_the_longest_stop_prefix():
    assert held_back("hello wo", ["world", "o"]) == 2
    assert held_back("abc", ["x"]) == 0


def test_accept_is_the_one_finish_rule(byte_level):
    """A stop string completed on the last token wins over "length"; a stop token's own text is not
    searched for stop strings; tokens after a stop are ignored."""
    seq = SequenceText(byte_level, ["END"])
    ids = byte_level.encode("xEND")
    assert [seq.accept(t, None) for t in ids[:-1]] == [None, None, None]
    assert seq.accept(ids[-1], "length") == "stop"
    assert seq.text == "x" and seq.stop_hit == "END"
    assert seq.accept(byte_level.encode("y")[0], None) == "stop" and seq.text == "x"

    by_token = SequenceText(byte_level, ["END"])
    for t in byte_level.encode("xEN"):
        assert by_token.accept(t, None) is None
    assert by_token.accept(byte_level.encode("D")[0], "stop") == "stop"
    assert by_token.stop_hit is None and by_token.text == "xEND"

    running = SequenceText(byte_level, ["END"])
    assert running.accept(byte_level.encode("a")[0], "length") == "length"
