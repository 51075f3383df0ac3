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

Behind `loraplex serve --replicas N` the ingress exports these per engine replica, each sample with a
leading `replica` label (the replica's id): `GatewayGauges(registry, per_replica=True)`.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

RESIDENT_TIERS = ("device", "cpu")


class GatewayGauges:
    def __init__(self, registry: CollectorRegistry, per_replica: bool = False, model_name: str = "") -> None:
        r = registry
        self.per_replica = per_replica
        self.model_name = model_name
        pre = ["replica"] if per_replica else []
        one = [*pre, "model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the batch", one, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", one, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", one, registry=r)
        self._scalars = (self.waiting, self.running, self.kv_usage)
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running and waiting adapters (value: time of the update)",
            [*pre, "max_lora", "running_lora_adapters", "waiting_lora_adapters", "model_name"],
            registry=r,
        )
        self.resident = Gauge(
            "loraplex_lora_adapter_resident",
            "1 for each adapter held by the pool, by tier",
            [*pre, "adapter", "digest", "tier", "pinned"],
            registry=r,
        )

    def name_model(self, model_name: str) -> None:
        """Label the gauges with `model_name` from now on; a single server's start at 0 until the engine
        reports (per replica, they appear with each replica's first report)."""
        self.model_name = model_name
        for gauge in self._scalars:
            gauge.clear()
            if not self.per_replica:
                gauge.labels(model_name).set(0)

    def refresh(self, engine: dict[str, Any], adapters: list[dict[str, Any]], max_loras: int) -> None:
        """Set every gauge from one engine stats snapshot (`EngineStats` and `LoRAInfo` as dicts)."""
        self.refresh_replicas([("", engine, adapters)], max_loras)

    def refresh_replicas(
        self, replicas: list[tuple[str, dict[str, Any], list[dict[str, Any]]]], max_loras: int
    ) -> None:
        """Set every gauge from (replica id, engine stats, adapters) per replica; replicas gone since the
        last refresh disappear. Without `per_replica` the list holds one entry (the id is not used)."""
        now, model = time.time(), self.model_name
        for gauge in (self.waiting, self.running, self.kv_usage, self.lora_info, self.resident):
            gauge.clear()
        for replica, engine, adapters in replicas:
            pre = [replica] if self.per_replica else []
            for gauge, key in zip(self._scalars, ("num_waiting", "num_running", "kv_usage"), strict=True):
                gauge.labels(*pre, model).set(engine[key])
            running = ",".join(engine.get("running_loras", []))
            waiting = ",".join(engine.get("waiting_loras", []))
            self.lora_info.labels(*pre, str(max_loras), running, waiting, model).set(now)
            for a in adapters:
                if a["tier"] not in RESIDENT_TIERS:
                    continue
                for name in a["names"] or [""]:
                    pinned = str(bool(a["pinned"])).lower()
                    self.resident.labels(*pre, name, a["digest"], a["tier"], pinned).set(1)
