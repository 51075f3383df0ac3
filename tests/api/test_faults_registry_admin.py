"""The admin plane under attack, on live servers: admin-token guessing is throttled per client on the
JSON API and the login form (forged X-Forwarded-For does not dodge it; the right token still works),
logout holds on another replica (sessions live in the registry database), hostile configs get 422s
naming the field, and `serve` refuses a short admin token."""

from __future__ import annotations

import io
import json
import re
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from typer.testing import CliRunner

from api.auth_throttle import AuthThrottle
from api.cli import app as cli
from tests.helpers.live_server import ADMIN_TOKEN, start_server
from tests.helpers.served import register

pytestmark = pytest.mark.slow  # live servers

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture(scope="module")
def servers(text_model, tmp_path_factory):
    """Two servers ("replicas") on one registry (the same data dir and SQLite database)."""
    base, adapters, _ = text_model
    data = tmp_path_factory.mktemp("admin-plane")
    register(data, base, "bot", adapters["all7-r4"])
    first = start_server(base, data)
    second = start_server(base, data)
    yield first, second
    first.stop()
    second.stop()


@pytest.fixture
def fresh_throttles(servers):
    for s in servers:
        s.state.auth_throttle = AuthThrottle()
    yield
    for s in servers:
        s.state.auth_throttle = AuthThrottle()


def _guess(url: str, token: str, forwarded: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} | ({"X-Forwarded-For": forwarded} if forwarded else {})
    return httpx.get(f"{url}/admin/api/adapters", headers=headers, timeout=30).status_code


def test_admin_api_guessing_is_throttled_and_the_right_token_still_works(servers, fresh_throttles):
    srv = servers[0]
    t0 = time.monotonic()
    with ThreadPoolExecutor(30) as pool:  # 30 guesses at once, each from a "different" forwarded address
        codes = list(pool.map(lambda i: _guess(srv.url, f"guess-{i:04d}-xxxxxxxx", f"10.0.0.{i}"), range(30)))
    took = time.monotonic() - t0
    assert set(codes) <= {403, 429}
    # Only the first failures (and the few allowed to wait) had their token checked at all.
    assert codes.count(403) <= 10 + 2 and codes.count(429) >= 15, codes
    # Now throttled: guesses come one per second or so, whatever X-Forwarded-For says.
    t1 = time.monotonic()
    assert _guess(srv.url, "another-wrong-token", "192.168.1.77") == 403
    assert time.monotonic() - t1 >= 0.9
    # The admin, on the same address, still gets in (after the same short delay), never a lockout.
    assert _guess(srv.url, ADMIN_TOKEN) == 200
    # The throttle is per client: the other replica's admin API is unaffected.
    assert _guess(servers[1].url, ADMIN_TOKEN) == 200
    assert took < 10


def _login_page(client: httpx.Client) -> str:
    match = _CSRF.search(client.get("/admin/login").text)
    assert match
    return match.group(1)


def _login(client: httpx.Client, token: str, forwarded: str | None = None) -> httpx.Response:
    csrf = _login_page(client)
    headers = {"X-Forwarded-For": forwarded} if forwarded else {}
    return client.post("/admin/login", data={"token": token, "csrf_token": csrf}, headers=headers)


def test_login_form_throttles_guessing_but_not_the_admin(servers, fresh_throttles):
    srv = servers[0]
    with httpx.Client(base_url=srv.url, timeout=30) as attacker:
        codes = [_login(attacker, f"wrong-{i}", f"172.16.0.{i}").status_code for i in range(12)]
    assert codes[:10] == [401] * 10
    assert srv.state.auth_throttle.throttled("127.0.0.1")  # forged addresses all counted as one client
    with httpx.Client(base_url=srv.url, timeout=30) as admin:
        r = _login(admin, ADMIN_TOKEN)
        assert r.status_code == 303, r.text
        assert admin.get("/admin").status_code == 200


def test_logout_holds_on_another_replica(servers, fresh_throttles):
    first, second = servers
    with httpx.Client(base_url=first.url, timeout=30) as client:
        assert _login(client, ADMIN_TOKEN).status_code == 303
        cookie = client.cookies.get("loraplex_admin_session")
        dash = client.get("/admin")
        csrf = _CSRF.search(dash.text)
        assert csrf
        with httpx.Client(base_url=second.url, timeout=30) as other:
            other.cookies.set("loraplex_admin_session", cookie, path="/admin")
            assert other.get("/admin").status_code == 200  # one session, valid on both replicas
            assert client.post("/admin/logout", data={"csrf_token": csrf.group(1)}).status_code == 303
            assert other.get("/admin").status_code == 303  # logged out there too: back to the login form


def _zip_with_config(adapter_dir, config: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("adapter_config.json", json.dumps(config))
        z.write(adapter_dir / "adapter_model.safetensors", "adapter_model.safetensors")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("base_model_name_or_path", {"x": 1}, "'base_model_name_or_path'"),
        ("extra", [[[[[[[[[[["deep"]]]]]]]]]]], "'extra': nested more than 8"),
        ("target_modules", "(q+)+_proj", "'target_modules': pattern"),
    ],
)
def test_hostile_config_upload_is_422_naming_the_field(servers, text_model, field, value, needle):
    adapter = text_model[1]["all7-r4"]
    config = json.loads((adapter / "adapter_config.json").read_text()) | {field: value}
    files = {"file": ("bad.zip", _zip_with_config(adapter, config), "application/zip")}
    r = servers[0].admin().post("/admin/api/adapters", data={"name": "hostile"}, files=files)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]


def test_serve_refuses_a_short_admin_token(text_model, tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ADMIN_TOKEN": "short-token"}
    result = CliRunner().invoke(cli, ["serve", "--model", str(text_model[0])], env=env)
    assert result.exit_code == 1
    assert "11 characters" in result.output and "at least 16" in result.output
