"""Bad input is refused with a clear ValueError before it reaches the model, and leaves nothing behind."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ModelConfigError


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint("llama")), device="cpu", dtype="float32", block_size=4, num_kv_blocks=40)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["hello"], SamplingParams())


def test_token_out_of_vocab(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10_000]], SamplingParams())


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 300], SamplingParams())


def test_request_that_cannot_fit_in_cache(llm):
    # 40 blocks of 4 = 160 tokens; 100 + 100 would need 50 blocks.
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=100))


def test_bad_batch_leaves_engine_clean(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6], []], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.get_stats().kv_blocks_used == 0
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_mismatched_per_prompt_lists(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [SamplingParams()])


def test_unsupported_checkpoints(tmp_path):
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")


def test_bad_engine_args(checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(checkpoint("llama")), device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="device"):
        LLM(str(checkpoint("llama")), device="tpu")
