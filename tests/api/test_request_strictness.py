"""Issue 25 items 6, 7, 8, 16 and 17 against a real server that requires API keys: unreadable adapter
paths are 400s, request bodies are typed strictly (no silent `true` → 1 or `"10"` → 10), a scoped key
cannot tell someone else's adapter from a missing one, malformed JSON is named as such, and a client that
hangs up on a non-streamed request costs one quiet log line and an aborted engine request."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from api.cli.output import CliError
from api.cli.remote import RemoteBackend
from tests.helpers.live_server import ADMIN_TOKEN, wait_until
from tests.helpers.served import serve_text_model

pytestmark = pytest.mark.slow  # a live server

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    srv = serve_text_model(
        text_model, tmp_path_factory.mktemp("data"), settings_overrides={"require_api_key": True}
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def scoped(server) -> str:
    """The secret of a key scoped to the adapter `all7-r4` only."""
    created = server.admin().post("/admin/api/keys", json={"name": "scoped-25", "adapters": ["all7-r4"]})
    assert created.status_code == 201, created.text
    return created.json()["secret"]


def _error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param, err
    return err


# ---- 6: a lora_path the server cannot even check is a 400, never a 500 -------------------------------
@pytest.mark.parametrize(
    "make_path",
    [
        lambda d: str(d / ("a" * 300)),  # a component over NAME_MAX: "File name too long"
        lambda d: str(d / ("a" * 300) / "adapter"),
        lambda d: "/" + "/".join(["b" * 200] * 20),  # longer than PATH_MAX
        lambda d: str(d) + "/bad\0name",  # a NUL byte: not a path at all
    ],
)
def test_unreadable_lora_path_is_400(server, tmp_path, make_path):
    body = {"lora_name": "long-path", "lora_path": make_path(tmp_path)}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=60)
    err = _error(r, 400, "lora_path")
    assert "lora_path" in err["message"], err


# ---- 7: strict types on the admin and OpenAI request bodies ------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"requests_per_minute": True}, "requests_per_minute"),
        ({"requests_per_minute": "10"}, "requests_per_minute"),
        ({"tokens_per_minute": 10.0}, "tokens_per_minute"),
        ({"max_concurrent": False}, "max_concurrent"),
        ({"max_concurrent": "2"}, "max_concurrent"),
    ],
)
def test_limits_patch_refuses_wrong_types(server, body, param):
    admin = server.admin()
    before = admin.get("/admin/api/adapters/gud-r12/limits").json()
    _error(admin.patch("/admin/api/adapters/gud-r12/limits", json=body), 400, param)
    _error(admin.patch("/admin/api/keys/scoped-25/limits", json=body), 400, param)
    assert admin.get("/admin/api/adapters/gud-r12/limits").json() == before


def test_limits_patch_still_takes_integers(server, scoped):
    admin = server.admin()
    r = admin.patch(
        "/admin/api/keys/scoped-25/limits", json={"requests_per_minute": 1000, "max_concurrent": 0}
    )
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 1000, r.text
    assert admin.patch("/admin/api/keys/scoped-25/limits", json={"requests_per_minute": 0}).status_code == 200


def test_cli_remote_backend_limits_are_strict(server, scoped):
    backend = RemoteBackend(server.url, ADMIN_TOKEN)
    try:
        with pytest.raises(CliError, match="requests_per_minute"):
            backend.set_limits("key", "scoped-25", True, None, None)  # type: ignore[arg-type]
        with pytest.raises(CliError, match="max_concurrent"):
            backend.set_limits("key", "scoped-25", None, None, "3")  # type: ignore[arg-type]
        assert backend.get_limits("key", "scoped-25").max_concurrent is None
    finally:
        backend.close()


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/admin/api/keys", {"name": "k1", "admin": "true"}, "admin"),
        ("/admin/api/keys", {"name": "k1", "admin": 1}, "admin"),
        ("/admin/api/keys", {"name": 7}, "name"),
        ("/admin/api/adapters/gud-r12/rollback", {"version": "1"}, "version"),
        ("/admin/api/adapters/gud-r12/rollback", {"version": True}, "version"),
        ("/v1/load_lora_adapter", {"lora_name": 1, "lora_path": "/x"}, "lora_name"),
    ],
)
def test_admin_bodies_refuse_wrong_types(server, path, body, param):
    _error(server.admin().post(path, json=body), 400, param)


COMP = {"model": "all7-r4", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "all7-r4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"echo": 1}, "echo"),
        ("/v1/completions", {"echo": "true"}, "echo"),
        ("/v1/completions", {"stream": "false"}, "stream"),
        ("/v1/completions", {"max_tokens": "2"}, "max_tokens"),
        ("/v1/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {"n": True}, "n"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"temperature": True}, "temperature"),
        ("/v1/completions", {"seed": "1"}, "seed"),
        ("/v1/completions", {"ignore_eos": 0}, "ignore_eos"),
        ("/v1/completions", {"model": 5}, "model"),
        (
            "/v1/completions",
            {"stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ("/v1/completions", {"stop": 1}, "stop"),  # a union: named by the field, not `stop.str`
        ("/v1/completions", {"prompt": True}, "prompt"),
        ("/v1/chat/completions", {"tool_choice": 5}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("/v1/chat/completions", {"parallel_tool_calls": "false"}, "parallel_tool_calls"),
        ("/v1/chat/completions", {"parallel_tool_calls": 0}, "parallel_tool_calls"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": "2"}, "max_completion_tokens"),
        ("/v1/chat/completions", {"user": 12}, "user"),
    ],
)
def test_openai_bodies_refuse_wrong_types(server, path, extra, param):
    base = COMP if path == "/v1/completions" else CHAT
    r = httpx.post(f"{server.url}{path}", json=base | extra, headers=ADMIN, timeout=60)
    err = _error(r, 400, param)
    assert err["type"] == "invalid_request_error"


def test_openai_numbers_keep_their_usual_forms(server):
    # An int where a float is expected is how JSON (and the openai client) writes 1.0: still valid.
    body = COMP | {"temperature": 1, "top_p": 1, "max_tokens": 2, "seed": 3, "echo": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN_TOKEN, max_retries=0, timeout=60)
    comp = client.completions.create(
        model="all7-r4", prompt="hi", max_tokens=2, temperature=1, top_p=1, echo=True, logprobs=1, seed=1
    )
    assert comp.choices[0].text.startswith("hi")
    chat = client.chat.completions.create(
        model="all7-r4",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        stream_options=None,
    )
    assert chat.choices[0].message is not None


# ---- 8: a scoped key cannot tell someone else's adapter from a missing one ---------------------------
def _as(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("POST", "/v1/adapters/{name}/completions", {"prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/adapters/{name}/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("GET", "/v1/adapters/{name}/models", None),
    ],
)
def test_scoped_key_sees_others_adapters_as_missing(server, scoped, method, path, body):
    def ask(name: str) -> httpx.Response:
        json = None if body is None else body | ({"model": name} if "{name}" not in path else {})
        return httpx.request(
            method, f"{server.url}{path.format(name=name)}", json=json, headers=_as(scoped), timeout=60
        )

    others = ask("gud-r12")  # active, but not this key's
    missing = ask("no-such-adapter")
    assert others.status_code == missing.status_code == 404, (others.text, missing.text)
    a, b = others.json()["error"], missing.json()["error"]
    assert a["message"].replace("gud-r12", "NAME") == b["message"].replace("no-such-adapter", "NAME")
    assert {k: v for k, v in a.items() if k != "message"} == {k: v for k, v in b.items() if k != "message"}
    assert a["code"] == "model_not_found"
    # The key's own adapter still answers, and /v1/models lists only it.
    mine = ask("all7-r4")
    assert mine.status_code == 200, mine.text
    models = httpx.get(f"{server.url}/v1/models", headers=_as(scoped), timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["all7-r4"]


def test_scoped_key_and_base_model(server, scoped):
    # The base model's name is public (it is the server's served model): refusing it stays a 403.
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers=_as(scoped),
        timeout=60,
    )
    assert r.status_code == 403, r.text


# ---- 16: malformed JSON is named as such, with no bogus param ---------------------------------------
@pytest.mark.parametrize(
    "raw, where",
    [
        (b'{"prompt": }', "line 1 column 12"),
        (b"{", "line 1 column 2"),
        (b'{\n  "prompt": "hi",\n  "max_tokens": 2,,\n}', "line 3 column 19"),
    ],
)
def test_malformed_json_body_is_named(server, raw, where):
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=raw,
        headers=ADMIN | {"content-type": "application/json"},
        timeout=30,
    )
    err = _error(r, 400, None)
    assert err["message"].startswith("invalid JSON in request body: "), err
    assert where in err["message"], err


# ---- 17: a client hanging up on a non-streamed request ----------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _server_log() -> Iterator[_Records]:
    """Every record the server's loggers (uvicorn's and loraplex's) write meanwhile."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "loraplex")]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, level in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)


def _hang_up_after_sending(server, path: str, body: bytes) -> None:
    """Send a request on a raw socket and close it before any answer comes."""
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {ADMIN_TOKEN}\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        running = wait_until(lambda: server.state.client.stats.engine["num_running"] > 0, timeout=30)
        assert running, "the request never ran in the engine"


def _engine_idle(server) -> bool:
    e = server.state.client.stats.engine
    return e["num_running"] == 0 and e["num_waiting"] == 0 and e["kv_blocks_used"] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_disconnect_is_one_quiet_line_and_aborts(server, path):
    # 32 choices of a whole context each: seconds of work on the tiny model, cut short by the hang-up.
    body = {"model": "all7-r4", "n": 32, "max_tokens": 250, "ignore_eos": True, "temperature": 0}
    body |= (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    aborted_before = _aborted(server)
    with _server_log() as log:
        _hang_up_after_sending(server, path, json.dumps(body).encode())
        assert wait_until(lambda: _aborted(server) > aborted_before, timeout=30), [
            r.getMessage() for r in log.records
        ]
        assert wait_until(lambda: _engine_idle(server), timeout=30), server.state.client.stats.engine
        time.sleep(0.5)  # anything logged at the end of the request's task
    loud = [r for r in log.records if r.levelno >= logging.WARNING]
    assert not loud, [(r.name, r.getMessage(), r.exc_info) for r in loud]
    assert not [r for r in log.records if r.exc_info], "a traceback was logged"
    quiet = [r for r in log.records if "disconnected" in r.getMessage()]
    assert len(quiet) == 1 and quiet[0].levelno in (logging.INFO, logging.DEBUG), [
        r.getMessage() for r in log.records
    ]


def _aborted(server) -> float:
    """Requests counted with status "aborted" on the server's metrics."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics", headers=ADMIN, timeout=10).text.splitlines():
        if line.startswith("loraplex_requests_total{") and 'status="aborted"' in line:
            total += float(line.split()[-1])
    return total
