"""`/metrics` of one `loraplex serve` carries the gauges the Gateway API Inference Extension reads."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.live_server import start_server
from tests.helpers.served import register

DEMO = Path(__file__).resolve().parents[2] / "demo"


def _samples(url: str) -> dict:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {f.name: f.samples for f in families}


def test_gateway_gauges_name_running_and_resident_adapters(tmp_path) -> None:
    data = tmp_path / "data"
    register(data, DEMO / "base", "upper", DEMO / "adapters" / "upper")
    register(data, DEMO / "base", "reverse", DEMO / "adapters" / "reverse")
    server = start_server(DEMO / "base", data, max_loras=3, num_threads=1)
    try:
        body = {
            "prompt": "hello world=",
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        started, done = threading.Event(), threading.Event()

        def long_requests() -> None:  # keep `upper` running while the metrics are read (bounded)
            url = f"{server.url}/v1/adapters/upper/completions"
            for _ in range(20):
                with httpx.stream("POST", url, json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()
                if done.is_set():
                    return

        t = threading.Thread(target=long_requests)
        t.start()
        assert started.wait(30)
        seen_running = False
        for _ in range(40):  # stats arrive twice a second
            s = _samples(server.url)
            (info,) = s["vllm:lora_requests_info"]
            labels = {"max_lora", "running_lora_adapters", "waiting_lora_adapters", "model_name"}
            assert set(info.labels) == labels and info.labels["model_name"] == "base"
            assert info.labels["max_lora"] == "3"
            if info.labels["running_lora_adapters"] == "upper":
                seen_running = True
                assert s["vllm:num_requests_running"][0].value >= 1
                break
            threading.Event().wait(0.1)
        done.set()
        t.join(60)
        assert seen_running
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert len(s[name]) == 1 and s[name][0].value >= 0
            assert s[name][0].labels == {"model_name": "base"}  # as vLLM labels them
        resident = s["loraplex_lora_adapter_resident"]
        assert all(set(x.labels) == {"adapter", "digest", "tier", "pinned"} for x in resident)
        assert {"upper"} <= {x.labels["adapter"] for x in resident if x.labels["tier"] == "device"}
    finally:
        server.stop()
