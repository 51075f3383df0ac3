"""`/tokenize`, `/detokenize` (vLLM's shapes), `/version` and `/ping` against a real demo server that
requires API keys: the tokens are the ones the generation routes feed the model, limits come before
tokenizing, and keys and scopes apply as on the generation routes (`/ping` and `/version` are public)."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest

from tests.helpers.live_server import ADMIN_TOKEN, start_server, wait_until
from tests.helpers.redis_service import require_redis
from tests.helpers.served import register
from tools.train_demo import DEMO_OUTPUTS

DEMO = Path(__file__).resolve().parents[2] / "demo"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    register(data, DEMO / "base", "upper", DEMO / "adapters" / "upper")
    register(data, DEMO / "base", "reverse", DEMO / "adapters" / "reverse")
    srv = start_server(
        DEMO / "base",
        data,
        num_threads=1,
        settings_overrides={"require_api_key": True, "max_prompt_chars": 200},
    )
    created = srv.admin().post("/admin/api/keys", json={"name": "upper-only", "adapters": ["upper"]})
    assert created.status_code == 201, created.text
    yield srv, created.json()["secret"]
    srv.stop()


def _post(srv, path: str, body: dict, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=60)


def test_tokenize_prompt_gives_the_ids_completions_run_on(demo):
    srv, _ = demo
    prompt = "hello world="
    r = _post(srv, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(prompt) + 1  # character tokens after <s>
    assert body["max_model_len"] == srv.state.client.info.max_model_len
    assert body["token_strs"] == ["<s>", *prompt]
    # The same ids as a token prompt answer what the text prompt answers: the demo base echoes.
    gen = {"max_tokens": 20, "temperature": 0, "stop": ["\n"]}
    by_ids = _post(srv, "/v1/completions", gen | {"prompt": body["tokens"]}).json()
    assert by_ids["choices"][0]["text"] == DEMO_OUTPUTS[None]("hello world").rstrip("\n")
    assert by_ids["usage"]["prompt_tokens"] == body["count"]
    plain = _post(srv, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][1:] and plain["token_strs"] is None


def test_detokenize_inverts_tokenize_and_refuses_ids_outside_the_vocabulary(demo):
    srv, _ = demo
    ids = _post(srv, "/tokenize", {"prompt": "abc xyz", "add_special_tokens": False}).json()["tokens"]
    r = _post(srv, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "abc xyz"}
    vocab = srv.state.client.info.vocab_size
    bad = _post(srv, "/detokenize", {"tokens": [*ids, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert _post(srv, "/detokenize", {"tokens": [-1]}).status_code == 400


def test_tokenize_chat_form_is_the_chat_prompt(demo):
    srv, _ = demo
    messages = [{"role": "user", "content": "hello="}]
    r = _post(srv, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    chat = _post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    text = _post(srv, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "<|user|>\nhello=\n<|assistant|>\n"  # the documented default template
    no_header = _post(srv, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert _post(srv, "/detokenize", {"tokens": no_header["tokens"]}).json()["prompt"] == "<|user|>\nhello=\n"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
        ({"prompt": "a", "continue_final_message": True}, "continue_final_message"),
        ({"prompt": "x" * 201}, "prompt"),  # over max_prompt_chars: refused before tokenizing
        ({"prompt": "a", "model": "nope"}, "model"),
    ],
)
def test_tokenize_bad_requests_are_4xx_naming_the_field(demo, body, param):
    srv, _ = demo
    r = _post(srv, "/tokenize", body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_keys_and_scopes_apply_to_the_tokenizer_routes(demo):
    srv, upper_only = demo
    assert _post(srv, "/tokenize", {"prompt": "a"}, token=None).status_code == 401
    assert _post(srv, "/detokenize", {"tokens": [5]}, token="wrong").status_code == 401
    assert _post(srv, "/tokenize", {"prompt": "a", "model": "upper"}, token=upper_only).status_code == 200
    # A key scoped to `upper` may not use the base model, and another adapter looks missing.
    assert _post(srv, "/tokenize", {"prompt": "a"}, token=upper_only).status_code == 403
    assert _post(srv, "/tokenize", {"prompt": "a", "model": "reverse"}, token=upper_only).status_code == 404


def test_ping_and_version_are_public(demo):
    srv, _ = demo
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{srv.url}/ping", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.put(f"{srv.url}/ping", timeout=10).status_code == 405
    from importlib import metadata

    r = httpx.get(f"{srv.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": metadata.version("loraplex")}


def test_tokenizer_routes_count_against_request_rate_limits(tmp_path):
    redis_url = require_redis()
    srv = start_server(
        DEMO / "base",
        tmp_path / "data",
        num_threads=1,
        env={"LORAPLEX_REDIS_URL": redis_url},
        settings_overrides={"require_api_key": True},
    )
    try:
        admin = srv.admin()
        name = f"tok-{secrets.token_hex(4)}"  # Redis outlives the data dir: a name no earlier run used
        created = admin.post("/admin/api/keys", json={"name": name, "admin": True})
        assert created.status_code == 201, created.text
        key = created.json()["secret"]
        r = admin.patch(f"/admin/api/keys/{name}/limits", json={"requests_per_minute": 2})
        assert r.status_code == 200, r.text
        assert wait_until(lambda: srv.state.usage.limiter.table.get("key", name) is not None, 10)
        answers = [
            _post(srv, "/tokenize", {"prompt": "a"}, token=key),
            _post(srv, "/detokenize", {"tokens": [5]}, token=key),
            _post(srv, "/tokenize", {"prompt": "a"}, token=key),
        ]
        assert [a.status_code for a in answers] == [200, 200, 429], answers[-1].text
        assert answers[-1].json()["error"]["type"]
    finally:
        srv.stop()


def test_tokenizer_bodies_are_sized_like_inference_bodies(demo):
    srv, _ = demo
    # Over the 1 MiB of non-inference routes, within max_request_bytes: read, then refused by the
    # prompt-character limit (before tokenizing), not by the body size.
    r = _post(srv, "/tokenize", {"prompt": "a" * (3 * 1024**2 // 2)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    limit = srv.state.settings.max_request_bytes
    big = httpx.post(
        f"{srv.url}/detokenize",
        content=b'{"tokens": [' + b"1," * (limit // 2) + b"1]}",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"},
        timeout=60,
    )
    assert big.status_code == 413
