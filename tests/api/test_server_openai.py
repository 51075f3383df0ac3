"""The OpenAI-compatible surface of a real server, driven by the official `openai` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import SERVED_ADAPTERS
from tests.helpers.live_server import wait_until
from tests.helpers.served import serve_text_model

pytestmark = pytest.mark.slow  # a live server

PROMPTS = ["hello world", "abc xyz", "Q: 2+2?"]


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    srv = serve_text_model(text_model, tmp_path_factory.mktemp("data"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(text_model):
    return AutoTokenizer.from_pretrained(text_model[0])


def client(server, adapter: str | None = None) -> openai.OpenAI:
    base = f"{server.url}/v1" if adapter is None else f"{server.url}/v1/adapters/{adapter}"
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)


def expected(text_model, tok, prompt: str, adapter: str | None, n: int = 8) -> str:
    _, adapters, oracle = text_model
    ids = oracle.greedy(tok.encode(prompt), n, adapters[adapter] if adapter else None)
    return tok.decode(ids)


@pytest.mark.parametrize("adapter", [None, *SERVED_ADAPTERS])
def test_completion_by_model_name_matches_peft(server, text_model, tok, adapter):
    model = adapter or server.state.settings.served_model_name
    r = client(server).completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == expected(text_model, tok, PROMPTS[0], adapter)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0])) and r.usage.completion_tokens == 8


def test_per_adapter_base_url(server, text_model, tok):
    c = client(server, "gud-r12")
    r = c.completions.create(
        model="ignored-by-per-adapter-url",
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.model == "gud-r12"
    assert r.choices[0].text == expected(text_model, tok, PROMPTS[1], "gud-r12")
    models = c.models.list()
    assert [m.id for m in models.data] == ["gud-r12"]


def test_streaming_equals_non_streaming(server):
    c = client(server)
    kw = dict(
        model="qv-r8-rslora", prompt=PROMPTS[2], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    full = c.completions.create(**kw).choices[0].text
    chunks = list(c.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream_and_usage(server):
    c = client(server, "all7-r4")
    msgs = [{"role": "user", "content": "hi there"}]
    full = c.chat.completions.create(model="x", messages=msgs, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(
        model="x",
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_stop_strings_n_and_logprobs(server, text_model, tok):
    c = client(server)
    text = expected(text_model, tok, PROMPTS[0], "all7-r4", 12)
    stop = text[4:6]
    r = c.completions.create(
        model="all7-r4", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], logprobs=2
    )
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].logprobs.tokens) == len(r.choices[0].logprobs.token_logprobs) > 0
    r = c.completions.create(model="all7-r4", prompt=PROMPTS, max_tokens=5, n=2, temperature=1.0, seed=3)
    assert sorted(ch.index for ch in r.choices) == list(range(6))
    again = c.completions.create(model="all7-r4", prompt=PROMPTS, max_tokens=5, n=2, temperature=1.0, seed=3)
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]


def test_models_lists_base_and_active_adapters(server):
    ids = [m.id for m in client(server).models.list().data]
    assert ids[0] == server.state.settings.served_model_name
    assert sorted(ids[1:]) == sorted(SERVED_ADAPTERS)


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        (dict(max_tokens=-1), 400, "max_tokens"),
        (dict(temperature=5.0), 400, "temperature"),
        (dict(top_p=0.0), 400, "top_p"),
        (dict(prompt="x" * 400), 400, "prompt"),
        (dict(model="no-such-adapter"), 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(server, kwargs, status, param):
    body = {"model": "all7-r4", "prompt": "hi", "max_tokens": 4} | kwargs
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    with pytest.raises(openai.APIStatusError) as exc:
        client(server).completions.create(**body)
    assert exc.value.status_code == status


def test_inactive_adapter_is_404_and_leaves_models(server):
    admin = server.admin()
    assert admin.post("/admin/api/adapters/gud-r12/deactivate").status_code == 200
    try:
        assert wait_until(lambda: "gud-r12" not in [m.id for m in client(server).models.list().data])
        with pytest.raises(openai.NotFoundError):
            client(server, "gud-r12").completions.create(model="x", prompt="hi", max_tokens=2)
    finally:
        assert admin.post("/admin/api/adapters/gud-r12/activate").status_code == 200
    assert wait_until(lambda: "gud-r12" in [m.id for m in client(server).models.list().data])


def test_many_concurrent_requests_across_adapters(server):
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        models = [None, *SERVED_ADAPTERS]

        async def one(i: int) -> str:
            model = models[i % len(models)] or server.state.settings.served_model_name
            r = await c.completions.create(
                model=model, prompt=f"req {i}", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].finish_reason

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await c.close()

    assert asyncio.run(run()) == ["length"] * 64
    stats = server.admin().get("/admin/api/pool").json()
    assert wait_until(lambda: server.state.client.stats.engine["kv_blocks_used"] == 0)
    assert stats["lora"]["resident"] >= 1


def test_client_disconnect_frees_engine_resources(server):
    body = {
        "model": "all7-r4",
        "prompt": "stream me",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # Connection closed after the first token: the engine must drop the request and its blocks.
    assert wait_until(lambda: server.state.client.num_in_flight() == 0, timeout=30)
    assert wait_until(
        lambda: (
            server.state.client.stats.engine["num_running"] == 0
            and server.state.client.stats.engine["kv_blocks_used"] == 0
        ),
        timeout=30,
    )


def test_metrics_exported(server):
    client(server).completions.create(model="all7-r4", prompt="m", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "loraplex_requests_total",
        "loraplex_time_to_first_token_seconds_bucket",
        "loraplex_time_per_output_token_seconds",
        "loraplex_kv_cache_usage_ratio",
        "loraplex_lora_pool_pages",
        "loraplex_num_requests_waiting",
        "loraplex_generation_tokens_total",
    ):
        assert name in text
    assert 'adapter="all7-r4"' in text
