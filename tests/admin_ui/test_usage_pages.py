"""The admin UI's usage page (charts per adapter and per key) and the adapter page's limits form, over
HTTP against a live server (the Chromium check is in test_browser.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.admin_ui.conftest import PRELOADED, csrf_from, logged_in_client, start_ui_server

pytestmark = pytest.mark.slow  # a live server


@pytest.fixture(scope="module")
def server(ui_model, tmp_path_factory):
    srv = start_ui_server(ui_model, tmp_path_factory)
    yield srv
    srv.stop()


def test_usage_page_charts_the_tokens_of_each_adapter_and_key(server) -> None:
    body = {"model": PRELOADED[0], "prompt": "hello", "max_tokens": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    total = r.json()["usage"]["total_tokens"]
    assert server.state.usage.recorder.flush()
    client, _ = logged_in_client(server)
    try:
        page = client.get("/admin/usage")
        assert page.status_code == 200
        html = page.text
        assert 'href="/admin/usage" aria-current="page"' in html
        adapter_chart = html.split('id="usage-adapter"')[1].split("</section>")[0]
        assert f"<title>{PRELOADED[0]}</title></polyline>" in adapter_chart
        assert f"{PRELOADED[0]}: {total} tokens" in adapter_chart  # the chart's description
        key_chart = html.split('id="usage-key"')[1].split("</section>")[0]
        assert "(no key)" in key_chart and "<svg" in key_chart
        week = client.get("/admin/usage", params={"range": "7d"}).text
        assert "per day" in week and f"<title>{PRELOADED[0]}</title>" in week
    finally:
        client.close()
    assert httpx.get(f"{server.url}/admin/usage", follow_redirects=False).status_code == 303


def test_limits_form_sets_and_clears_the_adapter_limits(server) -> None:
    client, csrf = logged_in_client(server)
    name = PRELOADED[1]
    path = f"/admin/adapters/{name}/limits"
    try:
        form = {
            "csrf_token": csrf,
            "requests_per_minute": "30",
            "tokens_per_minute": "",
            "max_concurrent": "2",
        }
        r = client.post(path, data=form)
        assert r.status_code == 303 and r.headers["location"] == f"/admin/adapters/{name}"
        limits = server.state.registry.limits.get("adapter", name)
        assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent) == (30, None, 2)
        page = client.get(f"/admin/adapters/{name}").text
        assert f"Limits of {name} saved." in page and 'name="requests_per_minute" inputmode="numeric"' in page
        assert 'value="30"' in page
        bad = client.post(path, data=form | {"max_concurrent": "-1", "csrf_token": csrf_from(page)})
        assert bad.status_code == 303 and "whole number" in client.get(f"/admin/adapters/{name}").text
        assert client.post(path, data=form | {"csrf_token": "forged"}).status_code == 403
        client.post(path, data={"csrf_token": csrf})  # all empty: no limits
        assert server.state.registry.limits.get("adapter", name).is_empty
    finally:
        client.close()
