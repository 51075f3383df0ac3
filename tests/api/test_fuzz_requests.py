"""Bounded fuzzing of the generation endpoints over their request models (hypothesis, seconds): whatever
the body, the answer is never a 5xx, errors have the OpenAI shape, and the engine neither restarts nor
keeps anything afterwards."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.conftest import SERVED_ADAPTERS
from tests.helpers.live_server import wait_until
from tests.helpers.served import serve_text_model

BIG = 2**70
garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-BIG, BIG),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.lists(st.integers(-BIG, BIG), max_size=4),
    st.lists(st.text(max_size=4), max_size=20),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(plausible, garbage)


COMMON = {
    "model": field(st.sampled_from([*SERVED_ADAPTERS, "no-such-model", ""])),
    "max_tokens": field(st.integers(-1, 6)),
    "temperature": field(st.floats(-1, 3, allow_nan=False)),
    "top_p": field(st.floats(-0.5, 1.5, allow_nan=False)),
    "top_k": field(st.integers(-2, 5)),
    "n": field(st.integers(-1, 3)),
    "stop": field(st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": field(st.lists(st.integers(-3, 120), max_size=3)),
    "seed": field(st.integers(-3, 2**64)),
    "priority": field(st.integers(-(2**40), 2**40)),
    "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
}
prompt = st.one_of(
    st.text(max_size=30),
    st.lists(st.text(max_size=8), max_size=4),
    st.lists(st.integers(-5, 200), max_size=8),
    st.lists(st.lists(st.integers(-5, 200), max_size=5), max_size=3),
    garbage,
)
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant"])), "content": field(st.text(max_size=30))}
)
completion_bodies = st.fixed_dictionaries(
    {"prompt": prompt},
    optional=COMMON | {"logprobs": field(st.integers(-1, 21)), "echo": field(st.booleans())},
)
chat_bodies = st.fixed_dictionaries(
    {"messages": field(st.lists(message, max_size=3))},
    optional=COMMON
    | {
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(-1, 21)),
        "max_completion_tokens": field(st.integers(-1, 6)),
    },
)


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    srv = serve_text_model(text_model, tmp_path_factory.mktemp("data"))
    yield srv
    assert httpx.get(f"{srv.url}/health", timeout=10).json() == {"status": "ok", "engine_restarts": 0}
    engine = srv.state.client.stats.engine
    assert wait_until(lambda: srv.state.client.stats.engine["kv_blocks_used"] == 0, timeout=30), engine
    srv.stop()


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(server, body):
    _check(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60))


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat(server, body):
    _check(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_fuzz_raw_bodies(server, raw):
    r = httpx.post(
        f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    _check(r)


content_part = st.fixed_dictionaries(
    {
        "type": field(st.sampled_from(["input_text", "output_text", "input_image"])),
        "text": field(st.text(max_size=8)),
    }
)
input_item = st.one_of(
    st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "developer", "assistant"]))},
        optional={
            "content": field(st.text(max_size=20) | st.lists(content_part, max_size=2)),
            "type": field(st.just("message")),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "function_call_output", "reasoning"])},
        optional={
            "call_id": field(st.text(max_size=6)),
            "name": field(st.text(max_size=6)),
            "arguments": field(st.text(max_size=6)),
            "output": field(st.text(max_size=6)),
        },
    ),
)
function_tool = st.fixed_dictionaries(
    {
        "type": field(st.sampled_from(["function", "web_search"])),
        "name": field(st.sampled_from(["f", "bad name"])),
    },
    optional={"parameters": field(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}))},
)
response_bodies = st.fixed_dictionaries(
    {
        "input": field(st.text(max_size=30) | st.lists(input_item, max_size=3)),
        "max_output_tokens": field(st.integers(-1, 6)),
    },
    optional={
        "model": COMMON["model"],
        "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"],
        "stream": COMMON["stream"],
        "instructions": field(st.text(max_size=10)),
        "tools": field(st.lists(function_tool, max_size=2)),
        "tool_choice": field(
            st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}])
        ),
        "previous_response_id": field(st.text(max_size=8)),
        "store": field(st.booleans()),
        "text": field(
            st.fixed_dictionaries(
                {
                    "format": field(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", "json_object", "json_schema"])}
                        )
                    )
                }
            )
        ),
        "metadata": field(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)),
    },
)
tokenize_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": COMMON["model"],
        "prompt": field(st.text(max_size=30)),
        "messages": field(st.lists(message, max_size=3)),
        "add_generation_prompt": field(st.booleans()),
        "add_special_tokens": field(st.booleans()),
        "return_token_strs": field(st.booleans()),
        "tokens": field(st.lists(st.integers(-5, 200), max_size=8)),
    },
)


@FUZZ
@given(body=response_bodies)
def test_fuzz_responses(server, body):
    _check(httpx.post(f"{server.url}/v1/responses", json=body, timeout=60))


@FUZZ
@given(body=tokenize_bodies, path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_fuzz_tokenizer_routes(server, body, path):
    _check(httpx.post(f"{server.url}{path}", json=body, timeout=60))
