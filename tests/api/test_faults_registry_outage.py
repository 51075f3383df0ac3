"""PostgreSQL refused or black-holed under a live server: active adapters keep answering exactly and
fast, every registry failure is an OpenAI-style JSON 503 (the keep-alive connection survives), and
`/ready` says the registry is down while `/health` (liveness) stays 200.

The server's registry URL points at a `FaultProxy` in front of the real PostgreSQL (127.0.0.1:5432).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url
from transformers import AutoTokenizer

from lora_registry import RegistrySettings, open_registry
from lora_registry.migrate import upgrade
from tests.helpers.live_server import start_server, wait_until
from tests.helpers.tcp_proxy import FaultProxy
from tests.lora_registry.pg import postgres_database

pytestmark = pytest.mark.slow  # a live server

ACTIVE = "all7-r4"
JSON = {"Content-Type": "application/json"}
BODY = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def outage(text_model, tmp_path_factory):
    """(server, proxy, expected tokens of ACTIVE on BODY) with the registry behind the proxy."""
    base, adapters, oracle = text_model
    data = tmp_path_factory.mktemp("outage")
    with postgres_database() as url, FaultProxy("127.0.0.1", 5432) as proxy:
        upgrade(url)
        reg = open_registry(RegistrySettings(data, url, model_path=base), auto_upgrade=False)
        try:
            reg.adapters.register(ACTIVE, adapters[ACTIVE], activate=True)
        finally:
            reg.close()
        proxied = make_url(url).set(port=proxy.port).render_as_string(False)
        env = {"LORAPLEX_DATABASE_URL": proxied, "LORAPLEX_DB_CONNECT_TIMEOUT": "2"}
        srv = start_server(base, data, env=env)
        try:
            tok = AutoTokenizer.from_pretrained(base)
            expected = oracle.greedy(tok.encode(BODY["prompt"]), BODY["max_tokens"], adapters[ACTIVE])
            yield srv, proxy, expected
        finally:
            proxy.restore()
            srv.stop()


def _tokens(url: str, model: str) -> tuple[int, list[int] | dict, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=BODY | {"model": model}, timeout=60)
    took = time.monotonic() - t0
    body = r.json()
    return r.status_code, (body["choices"][0]["token_ids"] if r.status_code == 200 else body), took


def _baseline(url: str, expected: list[int]) -> float:
    times = []
    for _ in range(4):
        status, tokens, took = _tokens(url, ACTIVE)
        assert status == 200 and tokens == expected
        times.append(took)
    return max(times)


def test_refused_registry_gives_json_503_and_the_connection_survives(outage):
    srv, proxy, expected = outage
    port = int(srv.url.rsplit(":", 1)[1])
    proxy.refuse()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        payload = json.dumps(BODY | {"model": "no-such-adapter"})
        conn.request("POST", "/v1/completions", payload, JSON)
        r = conn.getresponse()
        body = r.read()
        assert r.status == 503, body
        assert r.getheader("content-type", "").startswith("application/json")
        err = json.loads(body)["error"]
        assert err["type"] == "service_unavailable" and "registry" in err["message"]
        assert "Traceback" not in body.decode()
        sock = conn.sock
        # The same keep-alive connection carries the next request: an active adapter, served from memory.
        conn.request("POST", "/v1/completions", json.dumps(BODY | {"model": ACTIVE}), JSON)
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["choices"][0]["token_ids"] == expected
        assert conn.sock is sock
        conn.close()
        # Liveness stays up; readiness names the registry as the part that is down.
        assert httpx.get(f"{srv.url}/health").status_code == 200
        ready = httpx.get(f"{srv.url}/ready", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["engine"] == "ok" and ready.json()["registry"] != "ok"
        # Every admin route answers the outage as JSON 503 too.
        admin = srv.admin()
        for method, path in (
            ("GET", "/admin/api/adapters"),
            ("POST", f"/admin/api/adapters/{ACTIVE}/activate"),
        ):
            r = admin.request(method, path)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    finally:
        proxy.restore()
    assert wait_until(lambda: httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200, timeout=30)
    status, body, _ = _tokens(srv.url, "no-such-adapter")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_blackholed_registry_does_not_stall_active_adapters(outage):
    srv, proxy, expected = outage
    normal = _baseline(srv.url, expected)
    proxy.blackhole()
    stuck: list[tuple[int, object, float]] = []
    try:
        # 48 lookups of unknown names pile up on the stalled database (more than the lookup lane's
        # threads, and more than starlette's 40 shared worker threads would take)...
        with ThreadPoolExecutor(48) as pool:
            futures = [pool.submit(_tokens, srv.url, f"ghost-{i}") for i in range(48)]
            time.sleep(1.0)
            # ...while the innocent workload on the active adapter keeps its exact answers and latency.
            innocent: list[tuple[int, object, float]] = []
            lock = threading.Lock()

            def probe() -> None:
                result = _tokens(srv.url, ACTIVE)
                with lock:
                    innocent.append(result)

            threads = [threading.Thread(target=probe) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            ready = httpx.get(f"{srv.url}/ready", timeout=10)
            stuck = [f.result(timeout=60) for f in futures]
    finally:
        proxy.restore()
    assert len(innocent) == 8
    for status, tokens, took in innocent:
        assert status == 200 and tokens == expected
        assert took < max(3.0, 4 * normal), (took, normal)
    assert ready.status_code == 503 and ready.json()["registry"] != "ok"
    # The stalled lookups end as JSON 503s (bounded by the lookup timeout), never hang or 500.
    assert {s for s, _, _ in stuck} == {503}, stuck[:3]
    assert max(took for _, _, took in stuck) < 30
    assert wait_until(lambda: httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200, timeout=30)
    assert _tokens(srv.url, "ghost-0")[0] == 404


def test_registry_path_is_not_in_the_test_module(outage):
    # Guard against the fixture silently bypassing the proxy: the server's URL has the proxy's port.
    srv, proxy, _ = outage
    assert make_url(srv.state.registry.settings.database_url).port == proxy.port
    assert proxy.accepted > 0
    assert Path(srv.data_dir).is_dir()
