"""Admin API through a real server: uploads, activation without restart, rollback, delete, keys, auth."""

from __future__ import annotations

import io
import zipfile

import httpx
import openai
import pytest

from tests.api.conftest import register
from tests.helpers.live_server import start_server, wait_until

pytestmark = pytest.mark.slow  # a live server


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("admin_data")
    register(data, base, "existing", adapters["all7-r4"])
    srv = start_server(base, data)
    yield srv
    srv.stop()


def _zip(adapter_dir) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            z.write(adapter_dir / f, f"peft/{f}")
    return buf.getvalue()


def _complete(server, model: str) -> list[int]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_admin_routes_need_the_token(server):
    assert httpx.get(f"{server.url}/admin/api/adapters").status_code == 401
    bad = httpx.get(f"{server.url}/admin/api/adapters", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 403 and bad.json()["error"]["type"] == "permission_error"
    assert server.admin().get("/admin/api/adapters").status_code == 200


def test_upload_zip_activate_serves_without_restart(server, text_model):
    _, adapters, oracle = text_model
    admin = server.admin()
    files = {"file": ("support.zip", _zip(adapters["qv-r8-rslora"]), "application/zip")}
    r = admin.post("/admin/api/adapters", data={"name": "support-bot", "description": "support"}, files=files)
    assert r.status_code == 201, r.text
    assert r.json()["adapter"]["status"] != "active"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
            model="support-bot", prompt="hi", max_tokens=2
        )
    assert admin.post("/admin/api/adapters/support-bot/activate").status_code == 200
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_model[0])
    expected = oracle.greedy(tok.encode("hello"), 6, adapters["qv-r8-rslora"])
    assert wait_until(lambda: "support-bot" in server.state.follower.snapshot())
    assert _complete(server, "support-bot") == expected
    # Same content again: no new version (200, created False).
    again = admin.post("/admin/api/adapters", data={"name": "support-bot"}, files=files)
    assert again.status_code == 200 and again.json()["created"] is False


def test_dora_upload_serves_equal_to_peft(server, text_model, tmp_path):
    """A PEFT DoRA adapter uploaded through the admin API serves through the openai client, equal to PEFT."""
    from transformers import AutoTokenizer

    from tests.helpers.tiny_adapters import build_adapter

    base, _, oracle = text_model
    dora = build_adapter(
        base, tmp_path / "dora", seed=7, r=4, lora_alpha=8, target_modules="all-linear", use_dora=True
    )
    admin = server.admin()
    files = {"file": ("dora.zip", _zip(dora), "application/zip")}
    r = admin.post("/admin/api/adapters", data={"name": "dora-bot", "activate": "true"}, files=files)
    assert r.status_code == 201, r.text
    assert wait_until(lambda: "dora-bot" in server.state.follower.snapshot())
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model="dora-bot", prompt="hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    tok = AutoTokenizer.from_pretrained(base)
    expected = oracle.greedy(tok.encode("hello"), 6, dora)
    assert out.choices[0].text == tok.decode(expected)
    assert _complete(server, "dora-bot") == expected


def test_vocab_lora_and_trainable_tokens_uploads_serve_equal_to_peft(server, text_model, tmp_path):
    """Adapters with LoRA on embed_tokens / lm_head, with trainable tokens for the prompt's own token ids,
    and with modules_to_save copies of both, uploaded through the admin API, serve through the openai
    client equal to PEFT."""
    from transformers import AutoTokenizer

    from tests.helpers.tiny_adapters import build_adapter

    base, _, oracle = text_model
    tok = AutoTokenizer.from_pretrained(base)
    prompt = tok.encode("hello")
    kinds = {
        "vocab-bot": dict(target_modules=["embed_tokens", "lm_head", "q_proj"]),
        "tokens-bot": dict(target_modules=["v_proj"], trainable_token_indices=sorted(set(prompt))),
        "saved-bot": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    }
    admin = server.admin()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    for i, (name, kw) in enumerate(kinds.items()):
        d = build_adapter(base, tmp_path / name, seed=11 + i, r=4, lora_alpha=8, **kw)
        files = {"file": (f"{name}.zip", _zip(d), "application/zip")}
        r = admin.post("/admin/api/adapters", data={"name": name, "activate": "true"}, files=files)
        assert r.status_code == 201, r.text
        assert wait_until(lambda n=name: n in server.state.follower.snapshot())
        out = client.completions.create(
            model=name, prompt="hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        expected = oracle.greedy(prompt, 6, d)
        assert out.choices[0].text == tok.decode(expected, skip_special_tokens=True), name
        assert _complete(server, name) == expected


def test_upload_two_files_new_version_and_rollback(server, text_model):
    _, adapters, oracle = text_model
    admin = server.admin()
    d = adapters["gud-r12"]
    files = [
        ("file", ("adapter_config.json", (d / "adapter_config.json").read_bytes(), "application/json")),
        (
            "file",
            (
                "adapter_model.safetensors",
                (d / "adapter_model.safetensors").read_bytes(),
                "application/octet-stream",
            ),
        ),
    ]
    r = admin.post("/admin/api/adapters", data={"name": "existing", "activate": "true"}, files=files)
    assert r.status_code == 201 and r.json()["version"]["version"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_model[0])
    prompt = tok.encode("hello")
    v2 = oracle.greedy(prompt, 6, adapters["gud-r12"])
    assert wait_until(lambda: server.state.follower.snapshot()["existing"].version == 2)
    assert _complete(server, "existing") == v2
    assert admin.post("/admin/api/adapters/existing/rollback", json={"version": 1}).status_code == 200
    assert wait_until(lambda: server.state.follower.snapshot()["existing"].version == 1)
    assert _complete(server, "existing") == oracle.greedy(prompt, 6, adapters["all7-r4"])
    detail = admin.get("/admin/api/adapters/existing").json()
    assert [v["version"] for v in detail["versions"]] == [1, 2]


def test_refused_uploads_leave_nothing(server, text_model, tmp_path):
    admin = server.admin()
    before = admin.get("/admin/api/adapters").json()["data"]
    cfg = (
        (text_model[1]["all7-r4"] / "adapter_config.json")
        .read_text()
        .replace('"use_dora": false', '"use_dora": true')
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("adapter_config.json", cfg)
        z.write(text_model[1]["all7-r4"] / "adapter_model.safetensors", "adapter_model.safetensors")
    r = admin.post("/admin/api/adapters", data={"name": "dora"}, files={"file": ("a.zip", buf.getvalue())})
    assert r.status_code == 422 and "DoRA" in r.json()["error"]["message"]
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("../escape.json", "{}")
    r = admin.post("/admin/api/adapters", data={"name": "evil"}, files={"file": ("e.zip", evil.getvalue())})
    assert r.status_code in (400, 422) and r.json()["error"]["message"]
    r = admin.post(
        "/admin/api/adapters", data={"name": "bad name!"}, files={"file": ("e.zip", buf.getvalue())}
    )
    assert r.status_code in (400, 422)
    r = admin.post("/admin/api/adapters", data={"name": "x"}, files={"file": ("notes.txt", b"hello")})
    assert r.status_code == 400
    assert admin.get("/admin/api/adapters").json()["data"] == before


def test_oversized_upload_is_413(server):
    server.state.settings.max_upload_bytes = 1000
    try:
        r = server.admin().post(
            "/admin/api/adapters", data={"name": "big"}, files={"file": ("big.zip", b"\0" * 5000)}
        )
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    finally:
        server.state.settings.max_upload_bytes = 512 * 1024**2


def test_delete_and_vllm_compat_routes(server, text_model):
    admin = server.admin()
    path = str(text_model[1]["gud-r12"])
    assert (
        httpx.post(
            f"{server.url}/v1/load_lora_adapter", json={"lora_name": "compat", "lora_path": path}
        ).status_code
        == 401
    )
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "compat", "lora_path": path})
    assert r.status_code == 200, r.text
    assert wait_until(lambda: "compat" in server.state.follower.snapshot())
    assert len(_complete(server, "compat")) == 6
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "compat"}).status_code == 200
    assert wait_until(lambda: "compat" not in server.state.follower.snapshot())
    assert admin.delete("/admin/api/adapters/compat").status_code == 200
    assert admin.get("/admin/api/adapters/compat").status_code == 404
    pool = admin.get("/admin/api/pool").json()
    assert pool["healthy"] and pool["lora"]["pages_total"] > 0 and pool["info"]["device"] == "cpu"
    info = pool["info"]  # decode graphs are a CUDA feature: none on CPU, reported as such
    assert (info["cuda_graphs"], info["graph_capture_s"], info["graph_memory_bytes"]) == (0, 0.0, 0)


def test_api_keys_scope_adapters(server, text_model):
    admin = server.admin()
    other_path = str(text_model[1]["qv-r8-rslora"])
    assert admin.post(
        "/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": other_path}
    ).is_success
    assert wait_until(lambda: "other" in server.state.follower.snapshot())
    r = admin.post("/admin/api/keys", json={"name": "support-team", "adapters": ["existing"]})
    assert r.status_code == 201
    secret = r.json()["secret"]
    server.state.settings.require_api_key = True
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        anon = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "existing"})
        assert anon.status_code == 401
        # Unauthenticated callers learn nothing about which adapters exist.
        assert httpx.post(f"{server.url}/v1/completions", json=body | {"model": "nope"}).status_code == 401
        hdr = {"Authorization": f"Bearer {secret}"}
        ok = httpx.post(
            f"{server.url}/v1/completions", json=body | {"model": "existing"}, headers=hdr, timeout=60
        )
        assert ok.status_code == 200
        other = httpx.post(f"{server.url}/v1/adapters/other/completions", json=body, headers=hdr)
        # Another key's adapter is answered as if it did not exist (no probing of names).
        assert other.status_code == 404 and "other" in other.json()["error"]["message"]
        assert other.json()["error"]["code"] == "model_not_found"
        base = httpx.post(f"{server.url}/v1/completions", json=body, headers=hdr)
        assert base.status_code == 403
        assert admin.delete("/admin/api/keys/support-team").status_code == 200
        revoked = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "existing"}, headers=hdr)
        assert revoked.status_code == 401
    finally:
        server.state.settings.require_api_key = False


def test_changes_from_another_process_are_picked_up(server, text_model):
    # The local CLI writes to the same SQLite registry without the server's event bus.
    from tests.api.conftest import register

    register(server.data_dir, text_model[0], "from-cli", text_model[1]["gud-r12"])
    assert wait_until(lambda: "from-cli" in server.state.follower.snapshot(), timeout=30)
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert "from-cli" in [m["id"] for m in models]
