"""Structured output through the OpenAI surface of a real server, driven by the official `openai` client:
`response_format` (json_object, json_schema strict) and `tools` / `tool_choice` on a random tiny model,
so only the constraint can make the outputs valid."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from api.chat_template import render_chat
from api.openai_protocol import FunctionDef
from api.tool_calls import CallStream, ToolMode, parse_call
from tests.helpers.live_server import start_server
from tests.helpers.served import register
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer

pytestmark = pytest.mark.slow  # a live server

ADAPTERS = ("all7-r4", "qv-r8-rslora", "gud-r12")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "plan": {"enum": ["free", "pro"]},
        "emails": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "plan", "emails"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["utc", "cet"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    base = build_checkpoint(root / "model", "llama", vocab_size=100, max_position_embeddings=2048)
    save_char_tokenizer(base)
    data = root / "data"
    for i, name in enumerate(ADAPTERS):
        register(
            data, base, name, build_adapter(base, root / "adapters" / name, seed=i, **ADAPTER_SPECS[name])
        )
    srv = start_server(base, data, num_kv_blocks=512)
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _run(server, job: dict):
    c = client(server)
    if job["api"] == "chat":
        return c.chat.completions.create(messages=[{"role": "user", "content": job["prompt"]}], **job["kw"])
    return c.completions.create(prompt=job["prompt"], **job["kw"])


def _text(job, resp) -> tuple[str, str]:
    ch = resp.choices[0]
    return (ch.message.content if job["api"] == "chat" else ch.text), ch.finish_reason


def test_mixed_concurrent_batch_every_constrained_output_validates(server):
    models = ["base", *ADAPTERS]
    base_name = server.state.settings.served_model_name
    jobs = []
    for i, m in enumerate(models):
        model = base_name if m == "base" else m
        prompt = f"person {i}: who?"
        common = dict(model=model, max_tokens=200)
        jobs += [
            {
                "api": "chat",
                "prompt": prompt,
                "kind": "schema",
                "kw": common | dict(temperature=1.0, seed=i, n=2, response_format=_fmt(PERSON)),
            },
            {
                "api": "completions",
                "prompt": prompt,
                "kind": "schema",
                "kw": common | dict(temperature=0, extra_body={"response_format": _fmt(PERSON)}),
            },
            {
                "api": "chat",
                "prompt": prompt,
                "kind": "object",
                "kw": common | dict(temperature=0, response_format={"type": "json_object"}),
            },
            {
                "api": "chat",
                "prompt": prompt,
                "kind": "free",
                "kw": common | dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True}),
            },
            {
                "api": "completions",
                "prompt": prompt,
                "kind": "free",
                "kw": common | dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True}),
            },
        ]
    alone = {i: _text(j, _run(server, j)) for i, j in enumerate(jobs) if j["kind"] == "free"}
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _run(server, j), jobs))
    for i, (job, resp) in enumerate(zip(jobs, results, strict=True)):
        if job["kind"] == "free":
            assert _text(job, resp) == alone[i]  # untouched by constrained neighbours
            continue
        for ch in resp.choices:
            text = ch.message.content if job["api"] == "chat" else ch.text
            assert ch.finish_reason == "stop", (job, text)
            value = json.loads(text)
            if job["kind"] == "schema":
                jsonschema.validate(value, PERSON)
            else:
                assert isinstance(value, dict)


def test_streamed_json_schema_equals_non_streamed(server):
    kw = dict(
        model=server.state.settings.served_model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=200,
        temperature=0,
        response_format=_fmt(PERSON),
    )
    c = client(server)
    full = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full
    jsonschema.validate(json.loads(full), PERSON)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_call_round_trip(server, choice):
    c = client(server)
    model = ADAPTERS[0]
    messages = [{"role": "user", "content": "weather in paris?"}]
    r = c.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=150,
        temperature=1.0,
        seed=4,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    # the call and its result go back as the next turn's history
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"},
    ]
    nxt = c.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert nxt.choices[0].message.content and nxt.choices[0].message.tool_calls is None
    first_prompt = r.usage.prompt_tokens
    assert nxt.usage.prompt_tokens > first_prompt + len(call.function.arguments) + len("sunny, 21")


def test_tool_call_streams_openai_deltas(server):
    c = client(server)
    kw = dict(
        model="gud-r12",
        messages=[{"role": "user", "content": "time?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        temperature=0,
    )
    full = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [ch for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == full.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == full.function.arguments
    assert len(deltas) > 2  # the arguments arrive in pieces, not at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not ch.choices[0].delta.content for ch in chunks)


@pytest.mark.parametrize(
    ("api", "extra", "param"),
    [
        (
            "chat",
            {"response_format": _fmt({"type": "object", "not": {"type": "string"}})},
            "response_format.json_schema.schema",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ("chat", {"response_format": _fmt({"type": "frobnicate"})}, "response_format.json_schema.schema"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        (
            "chat",
            {"response_format": _fmt({"enum": ["x" * 100] * 1000})},
            "response_format.json_schema.schema",
        ),
        (
            "completions",
            {"response_format": _fmt({"type": "string", "pattern": "[a-"})},
            "response_format.json_schema.schema",
        ),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "tools[0].function.parameters",
        ),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ],
)
def test_invalid_schemas_get_400_naming_the_field(server, api, extra, param):
    c = client(server)
    model = server.state.settings.served_model_name
    with pytest.raises(openai.BadRequestError) as err:
        if api == "chat":
            c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}], extra_body=extra
            )
        else:
            c.completions.create(model=model, prompt="x", extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


# ---- the tool-call pieces without a server ------------------------------------------------------------


def _mode(**kw) -> ToolMode:
    return ToolMode({"get_time": FunctionDef(name="get_time", parameters=TIME)}, **kw)


def test_auto_mode_returns_a_call_only_for_a_whole_call_of_a_known_tool():
    tools = _mode().tools
    assert parse_call('{"name": "get_time", "arguments": {"tz": "utc"}}', tools)["function"] == {
        "name": "get_time",
        "arguments": '{"tz": "utc"}',
    }
    for text in ['{"name": "other", "arguments": {}}', "get_time now", '{"name": "get_time"}', "[1]"]:
        assert parse_call(text, tools) is None
    auto = CallStream(_mode(detect=True))
    assert auto.push('{"name": "get_time", ', False, None) == []  # held: may be a call
    (delta,) = auto.push('"arguments": {"tz": "cet"}}', True, "stop")
    assert delta["tool_calls"][0]["function"]["arguments"] == '{"tz": "cet"}' and auto.is_call
    text = CallStream(_mode(detect=True))
    assert text.push("Hello", False, None) == [{"content": "Hello"}]
    assert text.push(" there", True, "stop") == [{"content": " there"}] and not text.is_call


def test_default_chat_template_renders_tools_calls_and_results(server):
    tok = AutoTokenizer.from_pretrained(server.state.settings.model)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "utc"}}}
    prompt = render_chat(
        tok,
        [
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
        ],
        [TOOLS[1]],
    )
    assert prompt == (
        f"<|tools|>\n{json.dumps([TOOLS[1]])}\n<|user|>\ntime?\n<|assistant|>\n"
        '{"name": "get_time", "arguments": {"tz": "utc"}}\n<|tool|>\n12:00\n<|assistant|>\n'
    )
