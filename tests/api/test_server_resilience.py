"""Engine-process death and graceful shutdown, on real servers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers.live_server import ADMIN_TOKEN, free_port, start_server, wait_until


def test_engine_kill_gives_503_then_recovers(text_model, tmp_path):
    base = text_model[0]
    srv = start_server(base, tmp_path / "data")
    try:
        url = f"{srv.url}/v1/completions"
        body = {"prompt": "long one", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        result: dict = {}

        def slow_request() -> None:
            result["resp"] = httpx.post(url, json=body, timeout=120)

        t = threading.Thread(target=slow_request)
        t.start()
        assert wait_until(lambda: srv.state.client.num_in_flight() == 1, timeout=30)
        old_pid = srv.state.client.pid
        os.kill(old_pid, signal.SIGKILL)
        t.join(timeout=60)
        resp = result["resp"]
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable"
        # Unhealthy while restarting, then healthy with a new engine process.
        assert wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200, timeout=180)
        assert srv.state.client.pid != old_pid and srv.state.client.restarts == 1
        ok = httpx.post(url, json=body | {"max_tokens": 4}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_finishes_in_flight_request_and_exits(text_model, tmp_path):
    base = text_model[0]
    port = free_port()
    env = os.environ | {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}
    loraplex = str(Path(sys.executable).parent / "loraplex")
    cmd = [
        loraplex,
        "serve",
        "--model",
        str(base),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-kv-blocks",
        "128",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _healthy(url), timeout=180), "server did not start"
        result: dict = {}
        body = {"prompt": "bye", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

        def request() -> None:
            result["resp"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        t = threading.Thread(target=request)
        t.start()
        assert wait_until(lambda: _running(url) > 0, timeout=30)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert result["resp"].status_code == 200
        assert len(result["resp"].json()["choices"][0]["token_ids"]) == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
    assert "loraplex stopped" in out, out
    assert "Traceback" not in out, out


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _running(url: str) -> float:
    """Sequences the engine reports running (from the Prometheus gauge)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("loraplex_num_requests_running "))
    return float(line.split()[1])
