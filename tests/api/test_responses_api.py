"""`/v1/responses` (the OpenAI Responses API) with the official `openai` client and plain HTTP against a
real server (a tiny random llama): it answers what the chat path answers for the same conversation,
streams the events the client parses, makes function calls, continues stored responses, and refuses
what it does not do."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.live_server import ADMIN_TOKEN, start_server
from tests.helpers.served import register
from tests.helpers.tiny_adapters import ADAPTER_SPECS, build_adapter
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer

MAX_STORED = 4
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A served tiny random llama with a 2048-token context (its greedy replies are long and never
    empty, unlike the demo model's, which ends a chat-template prompt at once) and one adapter; API
    keys required."""
    root = tmp_path_factory.mktemp("responses")
    base = build_checkpoint(root / "model", "llama", vocab_size=100, max_position_embeddings=2048)
    save_char_tokenizer(base)
    data = root / "data"
    register(data, base, "all7-r4", build_adapter(base, root / "all7-r4", **ADAPTER_SPECS["all7-r4"]))
    settings = {"require_api_key": True, "responses_max_stored": MAX_STORED}
    srv = start_server(base, data, num_kv_blocks=512, settings_overrides=settings)
    created = srv.admin().post("/admin/api/keys", json={"name": "scoped", "adapters": ["all7-r4"]})
    assert created.status_code == 201, created.text
    yield srv, created.json()["secret"]
    srv.stop()


def _client(srv, key: str = ADMIN_TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat_text(srv, model: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """What the chat route answers (greedy) for `messages`, and its prompt size."""
    r = _client(srv).chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def test_text_and_message_input_answer_what_chat_answers(served):
    srv, _ = served
    client, base = _client(srv), srv.state.settings.served_model_name
    r = client.responses.create(model=base, input="hello=", max_output_tokens=6, temperature=0)
    text, n_prompt = _chat_text(srv, base, [{"role": "user", "content": "hello="}], 6)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == base
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == n_prompt and r.usage.output_tokens == 6
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # Message items with instructions, on an adapter, as the chat route runs them.
    items = [{"role": "user", "content": [{"type": "input_text", "text": "abc="}]}]
    r = client.responses.create(
        model="all7-r4", input=items, instructions="be", max_output_tokens=5, temperature=0
    )
    expected, n_prompt = _chat_text(
        srv, "all7-r4", [{"role": "system", "content": "be"}, {"role": "user", "content": "abc="}], 5
    )
    assert r.output_text == expected and r.usage.input_tokens == n_prompt and r.instructions == "be"
    # The per-adapter base URL answers the same.
    on_adapter = openai.OpenAI(base_url=f"{srv.url}/v1/adapters/all7-r4", api_key=ADMIN_TOKEN, max_retries=0)
    same = on_adapter.responses.create(input=items, instructions="be", max_output_tokens=5, temperature=0)
    assert same.output_text == expected and same.model == "all7-r4"


def test_json_schema_text_format_constrains_the_output(served):
    srv, _ = served
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER["parameters"], "strict": True}
    r = _client(srv).responses.create(
        input="json please", text={"format": fmt}, max_output_tokens=100, temperature=0
    )
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"city"}
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"


def test_streaming_events_as_the_client_parses_them(served):
    srv, _ = served
    client, base = _client(srv), srv.state.settings.served_model_name
    events = list(
        client.responses.create(model=base, input="hi=", max_output_tokens=6, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    expected, _ = _chat_text(srv, base, [{"role": "user", "content": "hi="}], 6)
    assert deltas == done.text == final.output_text == expected
    assert final.usage.output_tokens == 6
    # The client's stream helper, which rebuilds the response from the events and checks that they
    # agree (indices, item ids, lifecycle), accepts them.
    with client.responses.stream(model=base, input="hi=", max_output_tokens=6, temperature=0) as helper:
        rebuilt = list(helper)
    assert rebuilt[-1].type == "response.incomplete" and rebuilt[-1].response.output_text == expected
    # The streamed response was stored like any other.
    assert client.responses.retrieve(final.id).output_text == expected


def test_function_tools_give_function_call_items_streamed_or_not(served):
    srv, _ = served
    client, base = _client(srv), srv.state.settings.served_model_name
    r = client.responses.create(
        model=base,
        input="weather?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=120,
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(
        client.responses.create(
            model=base,
            input="weather?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    item = next(e for e in events if e.type == "response.output_item.done").item
    assert args == done.arguments == item.arguments == call.arguments  # greedy: the same call
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"
    with client.responses.stream(
        model=base,
        input="weather?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=120,
    ) as helper:
        list(helper)
        assert helper.get_final_response().output[0].arguments == call.arguments
    # The call's result goes back as a function_call_output item: the model's turn after it.
    follow = client.responses.create(
        model=base,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sun"}],
        temperature=0,
        max_output_tokens=3,
    )
    assert follow.output[0].type == "message" and follow.previous_response_id == r.id


def test_previous_response_id_continues_the_stored_conversation(served):
    srv, _ = served
    client, base = _client(srv), srv.state.settings.served_model_name
    first = client.responses.create(model=base, input="ab=", max_output_tokens=3, temperature=0)
    second = client.responses.create(
        model=base, input="cd=", previous_response_id=first.id, max_output_tokens=3, temperature=0
    )
    history = [
        {"role": "user", "content": "ab="},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "cd="},
    ]
    expected, n_prompt = _chat_text(srv, base, history, 3)
    assert second.output_text == expected and second.usage.input_tokens == n_prompt
    # The same conversation kept by the client: the earlier output items sent back as input.
    manual = client.responses.create(
        model=base,
        input=[{"role": "user", "content": "ab="}, *first.output, {"role": "user", "content": "cd="}],
        max_output_tokens=3,
        temperature=0,
    )
    assert manual.output_text == expected and manual.usage.input_tokens == n_prompt
    got = httpx.get(f"{srv.url}/v1/responses/{second.id}", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == expected


def test_store_false_and_retention_bound(served):
    srv, _ = served
    client, base = _client(srv), srv.state.settings.served_model_name
    unstored = client.responses.create(model=base, input="a=", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=base, input="b=", previous_response_id=unstored.id, max_output_tokens=1)
    assert err.value.body["param"] == "previous_response_id"
    ids = [
        client.responses.create(model=base, input="c=", max_output_tokens=1).id for _ in range(MAX_STORED + 1)
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the oldest went when the store was full
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    client.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[-1])


def test_keys_scope_responses_and_their_storage(served):
    srv, upper_only = served
    scoped = _client(srv, upper_only)
    with pytest.raises(openai.AuthenticationError):
        _client(srv, "wrong").responses.create(model="all7-r4", input="a=", max_output_tokens=1)
    with pytest.raises(openai.PermissionDeniedError):  # the base model is outside the key's scope
        scoped.responses.create(model=srv.state.settings.served_model_name, input="a=", max_output_tokens=1)
    own = scoped.responses.create(model="all7-r4", input="a=", max_output_tokens=1)
    assert scoped.responses.retrieve(own.id).id == own.id
    admins = _client(srv).responses.create(model="all7-r4", input="a=", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):  # another caller's response looks missing
        scoped.responses.retrieve(admins.id)
    with pytest.raises(openai.NotFoundError):
        scoped.responses.create(
            model="all7-r4", input="b=", previous_response_id=admins.id, max_output_tokens=1
        )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
    ],
)
def test_unsupported_or_bad_fields_are_400_naming_them(served, extra, param):
    srv, _ = served
    body = {"model": srv.state.settings.served_model_name, "input": "a="} | extra
    r = httpx.post(
        f"{srv.url}/v1/responses", json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_unused_fields_at_their_defaults_are_accepted(served):
    srv, _ = served
    unused = {
        "reasoning": None,
        "background": False,
        "include": [],
        "service_tier": "auto",
        "top_logprobs": 0,
    }
    body = {"input": "a=", "max_output_tokens": 2} | unused
    r = httpx.post(
        f"{srv.url}/v1/responses", json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60
    )
    assert r.status_code == 200, r.text


def test_unknown_ids_are_404(served):
    srv, _ = served
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    r = httpx.get(f"{srv.url}/v1/responses/resp_nope", headers=headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    assert httpx.get(f"{srv.url}/v1/responses/resp_nope", timeout=10).status_code == 401
    body = {"input": "a=", "model": "no-such-adapter"}
    assert httpx.post(f"{srv.url}/v1/responses", json=body, headers=headers, timeout=10).status_code == 404
