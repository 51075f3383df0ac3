"""Under `require_api_key`: `/v1/models` is scoped to the key, `/metrics` and the docs leak nothing by
default; OpenAI conformance of logprobs (top-k contents, text offsets) and of the model id."""

from __future__ import annotations

import json

import httpx
import pytest

from api.settings import ServerSettings, checkpoint_names
from tests.api.conftest import SERVED_ADAPTERS
from tests.helpers.live_server import ADMIN_TOKEN
from tests.helpers.served import serve_text_model


@pytest.fixture(scope="module")
def keyed(text_model, tmp_path_factory):
    srv = serve_text_model(
        text_model, tmp_path_factory.mktemp("data"), settings_overrides={"require_api_key": True}
    )
    created = srv.admin().post("/admin/api/keys", json={"name": "scoped", "adapters": ["all7-r4"]})
    assert created.status_code == 201
    yield srv, created.json()["secret"]
    srv.stop()


def _get(srv, path: str, token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{srv.url}{path}", headers=headers, timeout=30)


def test_models_are_scoped_to_the_key(keyed):
    srv, scoped = keyed
    assert _get(srv, "/v1/models", None).status_code == 401
    assert [m["id"] for m in _get(srv, "/v1/models", scoped).json()["data"]] == ["all7-r4"]
    everything = [m["id"] for m in _get(srv, "/v1/models", ADMIN_TOKEN).json()["data"]]
    assert everything[0] == srv.state.settings.served_model_name
    assert sorted(everything[1:]) == sorted(SERVED_ADAPTERS)
    # Someone else's adapter looks exactly like a missing one (issue 25, item 8).
    assert _get(srv, "/v1/adapters/gud-r12/models", scoped).status_code == 404


@pytest.mark.parametrize("path", ["/metrics", "/openapi.json", "/docs", "/redoc"])
def test_metrics_and_docs_need_the_admin_token_when_keys_are_required(keyed, path):
    srv, scoped = keyed
    for token, status in ((None, 401), ("wrong", 403), (scoped, 403)):
        r = _get(srv, path, token)
        assert r.status_code == status
        assert "all7-r4" not in r.text and r.json()["error"]["type"]
    assert _get(srv, path, ADMIN_TOKEN).status_code == 200


def test_access_settings_are_explicit(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_METRICS_ACCESS": "public"}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"_name_or_path": "Org/Some-Model-1B"}))
    s = ServerSettings.build(str(model), env=env, require_api_key=True)
    assert s.access("metrics") == "public" and s.access("docs") == "admin"
    assert (
        ServerSettings.build(str(model), env={"LORAPLEX_DATA_DIR": str(tmp_path)}).access("docs") == "public"
    )
    with pytest.raises(ValueError, match="docs_access"):
        ServerSettings.build(str(model), env=env | {"LORAPLEX_DOCS_ACCESS": "everyone"})
    assert checkpoint_names(model) == ["m", "Org/Some-Model-1B"]
    assert s.model_aliases == ("Org/Some-Model-1B",)


def test_checkpoint_name_is_accepted_as_model_id(keyed):
    srv, _ = keyed
    srv.state.settings.model_aliases = ("Org/Some-Model-1B",)
    body = {"model": "Org/Some-Model-1B", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200 and r.json()["model"] == srv.state.settings.served_model_name


def test_chat_top_logprobs_are_the_k_most_likely_tokens(keyed):
    srv, _ = keyed
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    for k in (1, 3):
        body = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": k,
            "ignore_eos": True,
        }
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        for entry in r.json()["choices"][0]["logprobs"]["content"]:
            top = entry["top_logprobs"]
            assert len(top) == k
            # Greedy: the chosen token is the most likely one, so it leads the top-k list.
            assert top[0]["token"] == entry["token"] and top[0]["logprob"] == pytest.approx(entry["logprob"])
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert bytes(entry["bytes"]).decode() == entry["token"]


def test_completion_text_offsets_index_the_returned_text(keyed):
    srv, _ = keyed
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {
        "prompt": "abc",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
    }
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=auth, timeout=60)
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["text_offset"]) == len(lp["tokens"]) == 6
    for offset, token in zip(lp["text_offset"], lp["tokens"], strict=True):
        assert 3 <= offset <= len(choice["text"])  # after the echoed prompt, inside the text
        assert choice["text"].startswith(token, offset) or token in ("<s>", "</s>", "<pad>", "<unk>")
    for top, token in zip(lp["top_logprobs"], lp["tokens"], strict=True):
        assert token in top and len(top) in (2, 3)  # chosen + the 2 most likely (chosen may be one)


def test_openapi_declares_the_real_responses(keyed):
    srv, _ = keyed
    spec = _get(srv, "/openapi.json", ADMIN_TOKEN).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/adapters/{name}/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "403", "404", "413", "429", "503"} <= set(responses)
        assert "422" not in responses  # validation errors are 400 with the OpenAI body
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    top_k = spec["components"]["schemas"]["CompletionRequest"]["properties"]["top_k"]
    assert top_k["maximum"] < 2**63 and top_k["minimum"] == -1
