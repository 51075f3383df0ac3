"""What `VllmMetrics` records for one request, read back through Prometheus' text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.vllm_metrics import VllmMetrics


def _samples(registry: CollectorRegistry) -> dict[str, list]:
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels: str) -> float:
    """The value of the one sample called `name` whose labels include `labels`."""
    return next(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_one_request_fills_every_family_under_the_model_name() -> None:
    registry = CollectorRegistry()
    m = VllmMetrics(registry, "m")
    # 2 choices: one stopped, one cut by a client that went away; 5 prompt and 11 generated tokens;
    # first token after 0.2 s, the last after 1.2 s: 10 gaps of 0.1 s.
    m.record(["stop", None], 5, 11, 0.2, 1.2)
    m.record(["length"], 3, 0, None, 0.05)  # no token came: no TTFT, no TPOT
    m.refresh({"num_preemptions": 2, "prefix_cache_queries": 40, "prefix_cache_hits": 16})
    s = _samples(registry)
    ttft = s["vllm:time_to_first_token_seconds"]
    assert _value(ttft, "vllm:time_to_first_token_seconds_count", model_name="m") == 1
    assert _value(ttft, "vllm:time_to_first_token_seconds_sum") == 0.2
    name = "vllm:time_per_output_token_seconds"
    assert _value(s[name], f"{name}_count") == 1
    assert abs(_value(s[name], f"{name}_sum") - 0.1) < 1e-9
    e2e = s["vllm:e2e_request_latency_seconds"]
    assert _value(e2e, "vllm:e2e_request_latency_seconds_count") == 2
    assert _value(e2e, "vllm:e2e_request_latency_seconds_bucket", le="0.3") == 1
    assert _value(s["vllm:prompt_tokens"], "vllm:prompt_tokens_total", model_name="m") == 8
    assert _value(s["vllm:generation_tokens"], "vllm:generation_tokens_total", model_name="m") == 11
    success = s["vllm:request_success"]
    for reason in ("stop", "abort", "length"):
        assert _value(success, "vllm:request_success_total", model_name="m", finished_reason=reason) == 1
    assert _value(s["vllm:num_preemptions"], "vllm:num_preemptions_total", model_name="m") == 2
    assert _value(s["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total") == 40
    assert _value(s["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") == 16


def test_inter_token_latency_is_one_observation_per_gap() -> None:
    registry = CollectorRegistry()
    m = VllmMetrics(registry, "m")
    for gap in (0.01, 0.02, 0.2):
        m.inter_token(gap)
    name = "vllm:inter_token_latency_seconds"
    s = _samples(registry)[name]
    assert _value(s, f"{name}_count", model_name="m") == 3
    assert abs(_value(s, f"{name}_sum") - 0.23) < 1e-9
    assert _value(s, f"{name}_bucket", le="0.025") == 2
