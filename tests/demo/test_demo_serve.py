"""Smoke test of the README's `make serve` path: `loraplex serve --model demo/base` with the four demo
adapters registered answers per-adapter requests over HTTP, exactly as the offline engine does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers.live_server import ADMIN_TOKEN, free_port, wait_until

pytestmark = pytest.mark.slow  # a live demo server

DEMO = Path(__file__).resolve().parents[2] / "demo"
ADAPTERS = ("upper", "reverse", "rot13", "novowels")
PROMPT = "hello world="


def _loraplex() -> str:
    return str(Path(sys.executable).parent / "loraplex")


def test_serve_demo_answers_per_adapter_requests(tmp_path):
    env = os.environ | {
        "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
        "LORAPLEX_MODEL": str(DEMO / "base"),
        "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    for name in ADAPTERS:  # what `make serve` does for a fresh registry
        subprocess.run(
            [_loraplex(), "adapters", "register", name, str(DEMO / "adapters" / name), "--activate"],
            env=env,
            check=True,
            capture_output=True,
        )
    port = free_port()
    proc = subprocess.Popen(
        [
            _loraplex(),
            "serve",
            "--model",
            str(DEMO / "base"),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _healthy(url), timeout=180), "demo server did not start"
        llm = LLM(str(DEMO / "base"), device="cpu", dtype="float32")
        params = SamplingParams(max_tokens=32, temperature=0, stop=["\n"])
        for name in ADAPTERS:
            body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stop": ["\n"]}
            r = httpx.post(f"{url}/v1/adapters/{name}/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            lr = LoRARequest(name, str(DEMO / "adapters" / name))
            offline = llm.generate([PROMPT], params, lora_request=lr)[0].outputs[0].text
            assert r.json()["choices"][0]["text"] == offline
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert sorted(m["id"] for m in models[1:]) == sorted(ADAPTERS)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
