"""Prometheus metrics of one server (its own registry, no process globals).

Request-path metrics are recorded by the routes; engine and adapter-pool gauges are refreshed from the
engine's latest stats message at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from api.gateway_metrics import GatewayGauges
from api.spec_metrics import SpecMetrics
from api.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self, per_replica: bool = False) -> None:
        """`per_replica`: the engine client reaches several engine replicas (`--replicas`), and the
        gateway gauges are exported per replica (a `replica` label) instead of for one engine."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraplex_requests", "Finished generation requests", ["adapter", "status"], registry=r
        )
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens", ["adapter"], registry=r)
        self.generation_tokens = Counter(
            "loraplex_generation_tokens", "Generated tokens", ["adapter"], registry=r
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "Time to first token",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "loraplex_time_per_output_token_seconds",
            "Time per output token after the first",
            ["adapter"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        g = lambda name, doc: Gauge(name, doc, registry=r)
        self.running = g("loraplex_num_requests_running", "Sequences in the running batch")
        self.waiting = g("loraplex_num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = g("loraplex_kv_cache_usage_ratio", "Fraction of KV blocks in use")
        self.kv_blocks = Gauge("loraplex_kv_blocks", "KV blocks by state", ["state"], registry=r)
        self.prefix_hits = g("loraplex_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self.prefix_queries = g("loraplex_prefix_cache_query_tokens", "Prompt tokens looked up")
        self.preemptions = g("loraplex_preemptions", "Preemptions so far")
        self.pool_pages = Gauge(
            "loraplex_lora_pool_pages", "Adapter pool pages by state", ["state"], registry=r
        )
        self.adapters_tier = Gauge("loraplex_lora_adapters", "Known adapters by tier", ["tier"], registry=r)
        self.lora_loads = g("loraplex_lora_loads", "Adapter loads from disk so far")
        self.lora_evictions = g("loraplex_lora_evictions", "Adapter pool evictions so far")
        self.engine_healthy = g("loraplex_engine_healthy", "1 when the engine process is up")
        self.engine_restarts = g("loraplex_engine_restarts", "Engine process restarts so far")
        self.gateway = GatewayGauges(r, per_replica=per_replica)
        self.spec = SpecMetrics(r)
        self.vllm = VllmMetrics(r)  # vLLM's names, for vLLM dashboards (api/vllm_metrics.py)

    def name_model(self, model_name: str) -> None:
        """Label the vLLM families (`model_name`) with the served model name."""
        self.vllm.model_name = model_name
        self.gateway.name_model(model_name)

    def refresh(self, client) -> None:
        """Copy the engine's latest statistics into the gauges."""
        bind = getattr(client, "bind_metrics", None)  # a client with metrics of its own (disaggregated)
        if bind is not None:
            bind(self.registry)
        self.engine_healthy.set(1 if client.healthy else 0)
        self.engine_restarts.set(client.restarts)
        stats = client.stats
        if stats is None:
            return
        e = stats.engine
        self.running.set(e["num_running"])
        self.waiting.set(e["num_waiting"])
        self.kv_usage.set(e["kv_usage"])
        self.kv_blocks.labels("used").set(e["kv_blocks_used"])
        self.kv_blocks.labels("cached_free").set(e["kv_blocks_cached_free"])
        self.kv_blocks.labels("free").set(e["kv_blocks_free"] - e["kv_blocks_cached_free"])
        self.prefix_hits.set(e["prefix_cache_hits"])
        self.prefix_queries.set(e["prefix_cache_queries"])
        self.preemptions.set(e["num_preemptions"])
        if self.gateway.per_replica:
            per = [(rid, st.engine, st.adapters) for rid, st in client.replica_stats()]
            self.gateway.refresh_replicas(per, client.config.max_loras)
        else:
            self.gateway.refresh(e, stats.adapters, client.config.max_loras)
        self.spec.refresh(e)
        self.vllm.refresh(e)
        if stats.lora is not None:
            self.pool_pages.labels("used").set(stats.lora["pages_used"])
            self.pool_pages.labels("free").set(stats.lora["pages_free"])
            self.lora_loads.set(stats.lora["loads"])
            self.lora_evictions.set(stats.lora["evictions"])
        tiers = {"device": 0, "cpu": 0, "loading": 0, "disk": 0}
        for a in stats.adapters:
            tiers[a["tier"]] = tiers.get(a["tier"], 0) + 1
        for tier, n in tiers.items():
            self.adapters_tier.labels(tier).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
