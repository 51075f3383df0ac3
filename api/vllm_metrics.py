"""The request metrics of vLLM's `/metrics`, under vLLM's names, so stock vLLM dashboards read loraplex.

Every family carries `model_name` (the served model name, as vLLM labels it); loraplex's own
`loraplex_*` families (per adapter) stay beside them:

    vllm:time_to_first_token_seconds      histogram, per request: arrival to first token
    vllm:time_per_output_token_seconds    histogram, per request: mean gap between output tokens
    vllm:inter_token_latency_seconds      histogram, per output-token gap: time between a choice's
                                          successive updates (one per engine step that gave it tokens)
    vllm:e2e_request_latency_seconds      histogram, per request: arrival to finish
    vllm:prompt_tokens_total              counter, prompt tokens of finished requests
    vllm:generation_tokens_total          counter, tokens generated for them
    vllm:request_success_total{finished_reason}   counter, choices that ended with stop / length /
                                          abort (cancelled, or the client went away) / error
    vllm:num_preemptions_total            counter, the engine's preemptions
    vllm:prefix_cache_queries_total       counter, prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total          counter, prompt tokens served from it

The engine keeps the last three as running totals; they are read from its latest stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# vLLM's own bucket edges, so a dashboard's quantiles mean the same thing.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# vLLM's engine counters: (name, help, key in the engine's stats message)
ENGINE_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemptions", "num_preemptions"),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache", "prefix_cache_hits"),
)


class _EngineCounters(Collector):
    """The engine's running totals as counters (the engine counts; this only reports its last values)."""

    def __init__(self, owner: VllmMetrics) -> None:
        self.owner = owner
        self.values: dict[str, float] = {}

    def collect(self) -> Iterable[CounterMetricFamily]:
        for name, doc, key in ENGINE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.owner.model_name], self.values.get(key, 0.0))
            yield family


class VllmMetrics:
    """vLLM's request families on `registry`; `model_name` is set once the server knows it."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        r, label = registry, ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Mean time per output token", TPOT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency", TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens", label, registry=r)
        self.success = Counter(
            "vllm:request_success",
            "Finished choices by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.engine = _EngineCounters(self)
        r.register(self.engine)

    def record(
        self,
        finish_reasons: Iterable[str | None],
        prompt_tokens: int,
        generation_tokens: int,
        ttft: float | None,
        duration: float,
    ) -> None:
        """Record one request that ran: its choices' finish reasons (None: it did not finish, counted as
        "abort"), its token counts, time to first token (None: no token came) and seconds from arrival
        to finish."""
        name = self.model_name
        for reason in finish_reasons:
            self.success.labels(name, reason or "abort").inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generation_tokens)
        self.e2e.labels(name).observe(duration)
        if ttft is None:
            return
        self.ttft.labels(name).observe(ttft)
        if generation_tokens > 1:
            gap = (duration - ttft) / (generation_tokens - 1)
            self.tpot.labels(name).observe(gap)

    def inter_token(self, seconds: float) -> None:
        """Record one gap between a choice's successive token updates."""
        self.itl.labels(self.model_name).observe(seconds)

    def refresh(self, engine: dict[str, Any]) -> None:
        """Take the engine's running totals from one stats snapshot (`EngineStats` as a dict)."""
        self.engine.values = {key: float(engine.get(key, 0)) for _, _, key in ENGINE_COUNTERS}
