"""`loraplex serve` start-up (issue 25, item 15): a port already in use fails at once, before the model
loads, as one line and exit 1, with no admin token created; a generated admin token is stored and shown
only once the server is serving."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from api.auth import TOKEN_FILE
from tests.helpers.live_server import free_port, wait_until


def _serve(model: Path, data_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The `loraplex serve` command line and environment (no admin token configured)."""
    loraplex = str(Path(sys.executable).parent / "loraplex")
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_ADMIN_TOKEN"}
    env |= {"LORAPLEX_DATA_DIR": str(data_dir)}
    cmd = [loraplex, "serve", "--model", str(model), "--port", str(port), "--device", "cpu"]
    return [*cmd, "--num-kv-blocks", "64", "--log-level", "info"], env


def test_port_in_use_fails_fast_without_a_token(text_model, tmp_path):
    data_dir = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd, env = _serve(text_model[0], data_dir, port)
        t0 = time.monotonic()
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], out
    assert "engine ready" not in out and "Traceback" not in out
    assert not (data_dir / TOKEN_FILE).exists(), "an admin token was stored for a server that never ran"
    assert took < 60, f"took {took:.1f}s"


def test_generated_token_is_stored_and_shown_once_serving(text_model, tmp_path):
    data_dir = tmp_path / "data"
    port = free_port()
    cmd, env = _serve(text_model[0], data_dir, port)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # until the token is shown (or the process ends)
            lines.append(line)
            if "Admin token" in line and "shown once" in line:
                break
        out = "".join(lines)
        assert "shown once" in out, out
        # By the time it is shown, the server is serving and the token is stored.
        token = next(ln for ln in lines if "shown once" in ln).split()[2]
        assert (data_dir / TOKEN_FILE).is_file()
        ready = next(i for i, ln in enumerate(lines) if "engine ready" in ln)
        running = next(i for i, ln in enumerate(lines) if "Uvicorn running on" in ln)
        shown = next(i for i, ln in enumerate(lines) if "shown once" in ln)
        assert ready < running < shown, out
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout=30)
        auth = {"authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/admin/api/adapters", headers=auth, timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
