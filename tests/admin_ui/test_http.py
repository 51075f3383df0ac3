"""HTTP-level checks of the admin UI on a real server: sessions, redirects, CSRF, cookies, headers."""

from __future__ import annotations

import httpx
import pytest

from tests.admin_ui.conftest import PRELOADED, csrf_from, logged_in_client, start_ui_server
from tests.helpers.live_server import ADMIN_TOKEN, wait_until

pytestmark = pytest.mark.slow  # a live server

PAGES = (
    "/admin",
    "/admin/adapters",
    f"/admin/adapters/{PRELOADED[0]}",
    "/admin/pool",
    "/admin/playground",
    "/admin/keys",
)


@pytest.fixture(scope="module")
def server(ui_model, tmp_path_factory):
    srv = start_ui_server(ui_model, tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture()
def anon(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture()
def admin(server):
    client, csrf = logged_in_client(server)
    yield client, csrf
    client.close()


@pytest.mark.parametrize("path", PAGES)
def test_pages_redirect_to_login_without_session(anon, path):
    r = anon.get(path)
    assert r.status_code == 303
    assert r.headers["location"].startswith("/admin/login?next=")
    assert path in httpx.URL(r.headers["location"]).params["next"]


def test_json_endpoints_answer_401_without_session(anon):
    assert anon.get("/admin/dashboard.json", headers={"Accept": "application/json"}).status_code == 401
    sse = {"Accept": "text/event-stream"}
    r = anon.post("/admin/playground/generate", json={"prompt": "hi"}, headers=sse)
    assert r.status_code == 401


def test_static_files_are_public_and_login_page_renders(anon):
    assert anon.get("/admin/static/admin.css").status_code == 200
    r = anon.get("/admin/login")
    assert r.status_code == 200 and 'name="token"' in r.text
    assert r.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_login_sets_a_strict_httponly_session_cookie(anon):
    page = anon.get("/admin/login")
    r = anon.post("/admin/login", data={"token": ADMIN_TOKEN, "csrf_token": csrf_from(page.text)})
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("loraplex_admin_session="))
    low = cookie.lower()
    assert "httponly" in low and "samesite=strict" in low and "path=/admin" in low
    assert anon.get("/admin").status_code == 200


def test_wrong_token_is_refused(anon):
    page = anon.get("/admin/login")
    r = anon.post("/admin/login", data={"token": "nope", "csrf_token": csrf_from(page.text)})
    assert r.status_code == 401 and "not the admin token" in r.text
    assert "loraplex_admin_session" not in anon.cookies
    assert anon.get("/admin").status_code == 303


def test_login_without_csrf_token_is_refused(anon):
    anon.get("/admin/login")
    assert anon.post("/admin/login", data={"token": ADMIN_TOKEN}).status_code == 403
    assert anon.post("/admin/login", data={"token": ADMIN_TOKEN, "csrf_token": "forged"}).status_code == 403
    fresh = httpx.post(f"{anon.base_url}/admin/login", data={"token": ADMIN_TOKEN, "csrf_token": "x"})
    assert fresh.status_code == 403  # no pre-session cookie at all


def test_login_next_must_stay_on_admin(anon):
    page = anon.get("/admin/login")
    data = {"token": ADMIN_TOKEN, "csrf_token": csrf_from(page.text), "next": "//evil.example/admin"}
    r = anon.post("/admin/login", data=data)
    assert r.status_code == 303 and r.headers["location"] == "/admin"


def test_tampered_cookie_is_not_a_session(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.cookies.set("loraplex_admin_session", "eyJzaWQiOiJ4IiwiY3NyZiI6InkifQ.forged.sig", path="/admin")
        assert c.get("/admin").status_code == 303


FORMS = (
    (f"/admin/adapters/{PRELOADED[0]}/deactivate", {}),
    (f"/admin/adapters/{PRELOADED[0]}/activate", {}),
    (f"/admin/adapters/{PRELOADED[0]}/rollback", {"version": "1"}),
    (f"/admin/adapters/{PRELOADED[0]}/delete", {"confirm": PRELOADED[0]}),
    ("/admin/keys", {"name": "sneaky", "scope": "admin"}),
    ("/admin/keys/sneaky/revoke", {}),
    ("/admin/adapters", {"name": "sneaky"}),
    ("/admin/logout", {}),
)


@pytest.mark.parametrize(("path", "data"), FORMS)
def test_forms_without_csrf_token_are_refused(server, admin, path, data):
    client, _ = admin
    assert client.post(path, data=data).status_code == 403
    assert client.post(path, data=data | {"csrf_token": "wrong"}).status_code == 403
    refused = client.post(path, data=data, headers={"Accept": "text/html"})
    assert refused.status_code == 403 and "CSRF" in refused.text
    # nothing changed: the adapter is still there and active, no key was made, the session still works
    assert PRELOADED[0] in server.state.follower.snapshot()
    assert all(k.name != "sneaky" for k in server.state.registry.keys.list())
    assert client.get("/admin").status_code == 200


def test_playground_stream_needs_csrf_header(admin):
    client, csrf = admin
    body = {"adapter": PRELOADED[0], "prompt": "hi", "max_tokens": 2}
    assert client.post("/admin/playground/generate", json=body).status_code == 403
    r = client.post("/admin/playground/generate", json=body, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and '"done":true' in r.text


def test_actions_with_csrf_token_work(server, admin):
    client, csrf = admin
    name = PRELOADED[1]
    r = client.post(f"/admin/adapters/{name}/deactivate", data={"csrf_token": csrf})
    assert r.status_code == 303 and r.headers["location"] == f"/admin/adapters/{name}"
    assert server.state.registry.adapters.show(name).adapter.status == "inactive"
    assert "is inactive" in client.get(r.headers["location"]).text  # the flash message
    client.post(f"/admin/adapters/{name}/activate", data={"csrf_token": csrf})
    assert server.state.registry.adapters.show(name).adapter.status == "active"


def test_refused_upload_shows_validator_message_in_page_and_json(admin, adapter_zips):
    client, csrf = admin
    refused = adapter_zips["refused"]
    files = {"file": (refused.name, refused.read_bytes(), "application/zip")}
    r = client.post("/admin/adapters", data={"name": "broken", "csrf_token": csrf}, files=files)
    assert r.status_code == 422 and "adapter_model.safetensors" in r.text
    assert "The adapter was refused" in r.text
    assert "ui-upload-" not in r.text  # the server's temp paths are not shown
    r = client.post(
        "/admin/adapters",
        data={"name": "broken"},
        files=files,
        headers={"Accept": "application/json", "X-CSRF-Token": csrf},
    )
    assert r.status_code == 422 and r.json()["ok"] is False
    assert any("adapter_model.safetensors" in m for m in r.json()["messages"])


def test_logout_revokes_the_session(server):
    client, csrf = logged_in_client(server)
    stolen = client.cookies.get("loraplex_admin_session")
    r = client.post("/admin/logout", data={"csrf_token": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"
    assert client.get("/admin").status_code == 303
    client.close()
    with httpx.Client(base_url=server.url, timeout=60) as replay:
        replay.cookies.set("loraplex_admin_session", stolen, path="/admin")
        assert replay.get("/admin").status_code == 303


def _pair(adapter_dir) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [
        ("file", (f, (adapter_dir / f).read_bytes(), "application/octet-stream"))
        for f in ("adapter_config.json", "adapter_model.safetensors")
    ]


def test_upload_two_files_then_roll_back_and_delete(server, admin, ui_model):
    client, csrf = admin
    _, adapters = ui_model
    svc = server.state.registry.adapters
    for version, source in ((1, "gud-r12"), (2, "all7-r4")):  # two contents under one name
        r = client.post(
            "/admin/adapters",
            data={"name": "pair", "description": "two files"},
            files=_pair(adapters[source]),
            headers={"Accept": "application/json", "X-CSRF-Token": csrf},
        )
        assert r.status_code == 201 and r.json()["ok"], r.text
        assert svc.show("pair").adapter.current.version == version
    page = client.get("/admin/adapters", params={"q": "two files"})
    assert 'data-name="pair"' in page.text and f'data-name="{PRELOADED[0]}"' not in page.text
    r = client.post("/admin/adapters/pair/rollback", data={"csrf_token": csrf, "version": "1"})
    assert r.status_code == 303 and svc.show("pair").adapter.current.version == 1
    client.post("/admin/adapters/pair/delete", data={"csrf_token": csrf, "confirm": "not-it"})
    assert svc.show("pair").adapter.name == "pair"  # a wrong confirmation deletes nothing
    r = client.post("/admin/adapters/pair/delete", data={"csrf_token": csrf, "confirm": "pair"})
    assert r.status_code == 303 and r.headers["location"] == "/admin/adapters"
    assert all(a.name != "pair" for a in svc.list())
    assert client.get("/admin/adapters/pair").status_code == 404


def test_dashboard_json_reports_engine_and_pool(admin):
    client, _ = admin
    data = client.get("/admin/dashboard.json", headers={"Accept": "application/json"}).json()
    assert data["healthy"] is True
    assert data["engine"]["kv_blocks_total"] > 0 and data["lora"]["pages_total"] > 0
    assert data["chart_svg"].startswith("<svg")
    assert set(data["tier_counts"]) == {"device", "loading", "cpu", "disk"}


def test_pool_lists_the_single_engine_as_one_replica(server, admin):
    """`GET /admin/api/pool` and `/admin/pool` without --replicas: one replica, `local`, holding the
    preloaded adapters; its numbers are the engine's own (the same as the summed top-level ones)."""
    client, _ = admin

    def pool() -> dict:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        return httpx.get(server.url + "/admin/api/pool", headers=headers, timeout=60).json()

    # the listing comes from the engine's periodic stats: on a busy machine an adapter the server handed
    # the engine at start may appear a stats period after the first look
    listed = lambda: {a["active_name"] for a in pool()["replicas"][0]["adapters"]} >= set(PRELOADED)
    assert wait_until(listed, timeout=30), pool()
    snapshot = pool()
    (local,) = snapshot["replicas"]
    assert local["replica"] == "local" and local["healthy"] is True
    assert local["kv_blocks_total"] == snapshot["engine"]["kv_blocks_total"] > 0
    assert local["lora"] == snapshot["lora"]
    assert set(local["tier_counts"]) == {"device", "loading", "cpu", "disk"}
    html = client.get("/admin/pool").text
    assert 'data-replica="local"' in html
    for name in PRELOADED:
        assert f'data-adapter="{name}"' in html


def test_dashboard_names_the_lora_path(admin):
    """The base-model card says how LoRA is applied (on CPU: the native kernel over float32 pages)."""
    client, _ = admin
    html = client.get("/admin").text
    assert "LoRA path</dt><dd>native · float32 pages</dd>" in html
