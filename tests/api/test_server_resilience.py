"""Engine-process death and graceful shutdown, on real servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers.live_server import ADMIN_TOKEN, free_port, start_server, wait_until

pytestmark = pytest.mark.slow  # live servers


def test_engine_kill_gives_503_then_recovers(text_model, tmp_path):
    base = text_model[0]
    srv = start_server(base, tmp_path / "data")
    try:
        url = f"{srv.url}/v1/completions"
        body = {"prompt": "long one", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        result: dict = {}

        def slow_request() -> None:
            result["resp"] = httpx.post(url, json=body, timeout=120)

        old_pid = srv.state.client.pid
        # frozen first, so a fast machine cannot finish the request before the kill lands (under load the
        # kill came after its last token once, and the request ended 200)
        os.kill(old_pid, signal.SIGSTOP)
        t = threading.Thread(target=slow_request)
        t.start()
        assert wait_until(lambda: srv.state.client.num_in_flight() == 1, timeout=30)
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
        body = {
            "prompt": "bye",
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = []
        # Streaming: once the first chunk is here the request is in flight for sure (a poll of the
        # running-requests gauge could miss a request the tiny model finishes in a fraction of a second).
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line.removeprefix("data: ")))
                if len(chunks) == 1:
                    proc.send_signal(signal.SIGTERM)
        assert chunks[-1]["usage"]["completion_tokens"] == 200  # finished after the signal
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
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
