"""The admin UI in a real headless Chromium: log in, upload (drag-and-drop), refused upload, activate and
deactivate, playground against two adapters, API keys, log out; screenshots of every page. At phone
width (390 px): no page scrolls sideways, long refusal messages wrap, charts open at "now", and each form
label sits with its own input (element boxes).

The steps share one server and one logged-in page and run in file order.
"""

from __future__ import annotations

import base64
import re

import httpx
import pytest

from tests.admin_ui.browser import (
    CHART_VIEW_JS,
    CLIPPED_JS,
    LABEL_BOXES_JS,
    PAGE_WIDTH_JS,
    chromium,
    label_sits_with_input,
    screenshot_dir,
)
from tests.admin_ui.conftest import LONG_MODULE, PRELOADED, UPLOADED, start_ui_server
from tests.helpers.live_server import ADMIN_TOKEN

pytestmark = pytest.mark.slow  # a live server and headless Chromium

DESKTOP = {"width": 1280, "height": 860}
NARROW = {"width": 390, "height": 844}
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def server(ui_model, tmp_path_factory):
    srv = start_ui_server(ui_model, tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def page(browser, server):
    context = browser.new_context(viewport=DESKTOP, base_url=server.url)
    context.set_default_timeout(TIMEOUT_MS)
    p = context.new_page()
    p.on("dialog", lambda d: d.accept())  # the confirmation prompts
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.js_errors = errors
    yield p
    context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return screenshot_dir(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture(scope="module")
def looks(tmp_path_factory):
    """Screenshots to look at, never committed (the phone-width layout checks)."""
    return tmp_path_factory.mktemp("looks")


def snap(page, shots, name: str) -> None:
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)


def test_login(page, shots):
    page.goto("/admin/adapters")
    assert "/admin/login" in page.url
    snap(page, shots, "login")
    page.fill("#token", "wrong-token")
    page.click("button[type=submit]")
    assert "not the admin token" in page.inner_text("#login-error")
    page.fill("#token", ADMIN_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/admin/adapters$"))
    assert page.locator("nav a[aria-current=page]").inner_text() == "Adapters"


def test_upload_zip_by_drag_and_drop_and_see_it_listed(page, adapter_zips, shots):
    page.goto("/admin/adapters")
    data = base64.b64encode(adapter_zips["good"].read_bytes()).decode()
    transfer = page.evaluate_handle(
        """([b64, name]) => {
            const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
            const dt = new DataTransfer();
            dt.items.add(new File([bytes], name, {type: "application/zip"}));
            return dt;
        }""",
        [data, adapter_zips["good"].name],
    )
    page.dispatch_event("[data-dropzone]", "drop", {"dataTransfer": transfer})
    assert page.input_value("#up-name") == UPLOADED  # suggested from the zip's name
    assert adapter_zips["good"].name in page.inner_text("[data-file-list]")
    page.check("input[name=activate]")
    page.click("#upload-form button[type=submit]")
    page.wait_for_url(f"**/admin/adapters/{UPLOADED}")
    assert f"Registered {UPLOADED} version 1" in page.inner_text(".flash")
    assert page.inner_text("#status-badge") == "active"
    page.goto("/admin/adapters")
    row = page.locator(f"#adapters-table tr[data-name='{UPLOADED}']")
    assert "active" in row.inner_text() and "12" in row.inner_text()  # status and rank
    page.fill("#q", "gud")  # the instant filter
    assert page.locator(f"tr[data-name='{PRELOADED[0]}']").is_hidden()
    page.fill("#q", "")
    snap(page, shots, "adapters")


def test_refused_upload_shows_the_validator_message(page, adapter_zips, shots):
    page.goto("/admin/adapters")
    page.fill("#up-name", "broken")
    page.set_input_files("#up-file", str(adapter_zips["refused"]))
    page.click("#upload-form button[type=submit]")
    errors = page.locator("[data-errors]")
    errors.wait_for(state="visible")
    assert "adapter_model.safetensors" in errors.inner_text()
    assert page.url.endswith("/admin/adapters")
    snap(page, shots, "adapters-refused-upload")


def test_activate_and_deactivate(page, server, shots):
    page.goto(f"/admin/adapters/{UPLOADED}")
    with page.expect_navigation():
        page.click("button:has-text('Deactivate')")
    assert page.inner_text("#status-badge") == "inactive"
    assert "is inactive" in page.inner_text(".flash")
    url = f"{server.url}/v1/adapters/{UPLOADED}/completions"
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 404
    with page.expect_navigation():
        page.click("button:text-is('Activate')")
    assert page.inner_text("#status-badge") == "active"
    assert "is active" in page.inner_text(".flash")
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
    assert f"/v1/adapters/{UPLOADED}" in page.input_value("#endpoint-url")
    assert "from openai import OpenAI" in page.inner_text("#snippet-python")
    snap(page, shots, "adapter-detail")


def test_playground_against_two_adapters(page, server, shots):
    page.goto("/admin/playground")
    chosen = (PRELOADED[0], UPLOADED)
    for box in page.locator("input[name=target]").all():
        box.set_checked(box.get_attribute("value") in chosen)
    page.fill("#pg-prompt", "hello world")
    page.fill("#pg-max", "12")
    page.click("[data-run]")
    page.wait_for_selector(".output[data-done='1'] >> nth=1")
    texts = {}
    for name in chosen:
        col = page.locator(f".output[data-target='{name}']")
        texts[name] = col.locator(".output-text").inner_text()
        assert "tokens in" in col.locator(".output-meta").inner_text()
    for name in chosen:  # the same greedy text as the per-adapter endpoint
        r = httpx.post(
            f"{server.url}/v1/adapters/{name}/completions",
            json={"prompt": "hello world", "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert r.json()["choices"][0]["text"] == texts[name]
    snap(page, shots, "playground")


def test_create_and_revoke_a_key(page, server, shots):
    page.goto("/admin/keys")
    page.fill("#key-name", "support-frontend")
    page.check(f"input[name=adapters][value='{PRELOADED[0]}']")
    page.click("#key-form button[type=submit]")
    secret = page.input_value("#new-key")
    assert secret.startswith("lpx_")
    key = server.state.registry.keys.verify(secret)
    assert key is not None and key.scopes == (f"adapter:{PRELOADED[0]}",)
    snap(page, shots, "keys-created")
    page.goto("/admin/keys")
    assert page.locator("#new-key").count() == 0  # shown once only
    row = page.locator("#keys-table tr[data-key='support-frontend']")
    with page.expect_navigation():
        row.locator("button:has-text('Revoke')").click()
    page.wait_for_selector("#keys-table tr[data-key='support-frontend'] .badge:has-text('revoked')")
    assert server.state.registry.keys.verify(secret) is None
    snap(page, shots, "keys")


def test_dashboard_shows_engine_pool_and_traffic(page, shots):
    page.goto("/admin")
    assert page.locator("#c-model + .big").inner_text()
    assert page.locator("#residency tbody tr").count() >= 1
    page.wait_for_selector("#dashboard[data-updated]", state="attached")  # one live poll done
    chart = page.locator("[data-chart] svg")
    assert chart.locator("polyline").count() >= 2  # both playground adapters had traffic
    assert UPLOADED in chart.inner_html()
    snap(page, shots, "dashboard")


def test_pool_page_shows_the_engine_pool(page, shots):
    """Without --replicas the pool page has one section: the local engine, with its adapters by tier."""
    page.click("nav a:has-text('Pool')")
    page.wait_for_url("**/admin/pool")
    sections = page.locator("section[data-replica]")
    assert sections.count() == 1 and sections.get_attribute("data-replica") == "local"
    assert "healthy" in sections.locator("h2 .badge").inner_text()
    rows = sections.locator("tbody tr[data-adapter]")
    assert rows.count() >= 1  # the playground's adapters are held by the engine
    assert UPLOADED in sections.locator("tbody").inner_text()
    snap(page, shots, "pool")


def test_usage_page_renders_its_charts(page, server, shots):
    assert server.state.usage.recorder.flush()  # the playground's requests are in the database now
    page.click("nav a:has-text('Usage')")
    page.wait_for_url("**/admin/usage")
    chart = page.locator("#usage-adapter [data-chart] svg")
    assert chart.is_visible() and chart.bounding_box()["height"] > 100
    assert chart.locator("polyline").count() >= 2  # both playground adapters
    assert UPLOADED in chart.inner_html()
    assert page.locator("#usage-key [data-chart] svg").is_visible()
    snap(page, shots, "usage")


def test_narrow_screen(page, shots):
    page.set_viewport_size(NARROW)
    try:
        narrow = (
            ("/admin", "dashboard-narrow"),
            ("/admin/adapters", "adapters-narrow"),
            ("/admin/pool", "pool-narrow"),
        )
        for path, name in narrow:
            page.goto(path)
            width = page.evaluate(PAGE_WIDTH_JS)
            assert width <= NARROW["width"], f"{path} overflows horizontally ({width}px)"
            snap(page, shots, name)
        for path in (f"/admin/adapters/{UPLOADED}", "/admin/keys", "/admin/usage", "/admin/playground"):
            page.goto(path)
            assert page.evaluate(PAGE_WIDTH_JS) <= NARROW["width"], f"{path} overflows horizontally"
    finally:
        page.set_viewport_size(DESKTOP)


@pytest.mark.parametrize("viewport", [NARROW, DESKTOP], ids=["phone", "desktop"])
def test_long_refusal_messages_wrap_inside_their_box(page, adapter_zips, looks, viewport):
    page.set_viewport_size(viewport)
    try:
        page.goto("/admin/adapters")  # the upload's refusal, shown by upload.js
        page.fill("#up-name", "long-module")
        page.set_input_files("#up-file", str(adapter_zips["long_message"]))
        page.click("#upload-form button[type=submit]")
        errors = page.locator("[data-errors]")
        errors.wait_for(state="visible")
        assert LONG_MODULE in errors.inner_text()
        snap(page, looks, f"long-refusal-{viewport['width']}")
        assert page.evaluate(PAGE_WIDTH_JS) <= viewport["width"]
        assert not page.locator("[data-errors], [data-errors] li").evaluate_all(CLIPPED_JS)
        page.goto("/admin/keys")  # a server-rendered refusal
        page.fill("#key-name", "k" * 300)
        page.check("input[name=scope][value=admin]")
        page.click("#key-form button[type=submit]")
        assert "k" * 300 in page.inner_text(".form-errors")
        assert page.evaluate(PAGE_WIDTH_JS) <= viewport["width"]
        assert not page.locator(".form-errors, .form-errors li").evaluate_all(CLIPPED_JS)
    finally:
        page.set_viewport_size(DESKTOP)


def test_phone_charts_open_at_now(page, looks):
    page.set_viewport_size(NARROW)
    try:
        page.goto("/admin")
        snap(page, looks, "dashboard-chart-narrow")
        chart = page.locator("#dashboard [data-chart]")
        view = chart.evaluate(CHART_VIEW_JS)
        assert view["atEnd"] and view["latest"] >= 3 and view["hidden"] == 0, view  # two lines' ends, "now"
        page.evaluate("document.getElementById('dashboard').removeAttribute('data-updated')")
        page.wait_for_selector("#dashboard[data-updated]", state="attached")  # a live poll redrew it
        assert chart.evaluate(CHART_VIEW_JS) == view
        page.goto("/admin/usage")
        for box in page.locator("[data-chart]").all():  # by adapter (with traffic), by key
            view = box.evaluate(CHART_VIEW_JS)
            assert view["atEnd"] and view["hidden"] == 0, view
        assert page.locator("[data-chart='adapter']").evaluate(CHART_VIEW_JS)["latest"] >= 2
    finally:
        page.set_viewport_size(DESKTOP)


@pytest.mark.parametrize("viewport", [NARROW, DESKTOP], ids=["phone", "desktop"])
def test_each_label_sits_with_its_input(page, looks, viewport):
    page.set_viewport_size(viewport)
    try:
        page.goto(f"/admin/adapters/{PRELOADED[0]}")
        snap(page, looks, f"limits-{viewport['width']}")
        for form in ("#limits-form", "form[action$='/delete']"):
            boxes = page.locator(form).evaluate(LABEL_BOXES_JS)
            assert len(boxes) == (3 if form == "#limits-form" else 1), form
            for field, label, control in boxes:  # stacked on a phone, beside or above on a desktop
                stacked = viewport["width"] < 640
                assert label_sits_with_input(label, control, stacked), f"{form} {field}: {label} vs {control}"
    finally:
        page.set_viewport_size(DESKTOP)


def test_logout(page):
    page.goto("/admin")
    page.click("button:has-text('Log out')")
    page.wait_for_url("**/admin/login")
    assert "logged out" in page.inner_text(".flash")
    page.goto("/admin/keys")
    assert "/admin/login" in page.url
    assert not page.js_errors, page.js_errors
