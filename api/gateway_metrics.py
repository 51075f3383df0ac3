"""The gauges an external request router reads from `/metrics` (Gateway API Inference Extension).

The Inference Extension's endpoint picker (and llm-d's) scores each serving pod by vLLM's metric names:

    vllm:num_requests_waiting      sequences queued            vllm:num_requests_running   in the batch
    vllm:kv_cache_usage_perc       fraction of KV blocks used (0..1, as vLLM reports it)
    vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters} = update time;
        the adapter labels are comma-separated names

each also labelled `model_name` (the served model name, as vLLM labels its gauges; a picker selects by
metric name, so the extra label changes nothing for it),

and, beyond what vLLM exports, `loraplex_lora_adapter_resident{adapter, digest, tier, pinned}` = 1 for
every adapter a pool holds (tier "device" or "cpu"), so that a router also sees idle resident adapters.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

RESIDENT_TIERS = ("device", "cpu")


class GatewayGauges:
    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        r, label = registry, ["model_name"]
        self.model_name = model_name
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the batch", label, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", label, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", label, registry=r)
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running and waiting adapters (value: time of the update)",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters", "model_name"],
            registry=r,
        )
        self.resident = Gauge(
            "loraplex_lora_adapter_resident",
            "1 for each adapter held by the pool, by tier",
            ["adapter", "digest", "tier", "pinned"],
            registry=r,
        )

    def name_model(self, model_name: str) -> None:
        """Label the gauges with `model_name` from now on (each starts at 0 until the engine reports)."""
        self.model_name = model_name
        for gauge in (self.waiting, self.running, self.kv_usage):
            gauge.clear()
            gauge.labels(model_name).set(0)

    def refresh(self, engine: dict[str, Any], adapters: list[dict[str, Any]], max_loras: int) -> None:
        """Set every gauge from one engine stats snapshot (`EngineStats` and `LoRAInfo` as dicts)."""
        name = self.model_name
        self.waiting.labels(name).set(engine["num_waiting"])
        self.running.labels(name).set(engine["num_running"])
        self.kv_usage.labels(name).set(engine["kv_usage"])
        self.lora_info.clear()
        self.lora_info.labels(
            str(max_loras),
            ",".join(engine.get("running_loras", [])),
            ",".join(engine.get("waiting_loras", [])),
            name,
        ).set(time.time())
        self.resident.clear()
        for a in adapters:
            if a["tier"] not in RESIDENT_TIERS:
                continue
            for name in a["names"] or [""]:
                self.resident.labels(name, a["digest"], a["tier"], str(bool(a["pinned"])).lower()).set(1)
