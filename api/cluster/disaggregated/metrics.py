"""The ingress's KV-transfer metrics, added to its `/metrics` (`Metrics.refresh` binds them once).

- `loraplex_kv_transfers_total{outcome}`: handoffs from a prefill to a decode replica ("ok", "failed",
  "timeout");
- `loraplex_kv_transfer_bytes_total`: KV bytes moved;
- `loraplex_kv_transfer_seconds`: from the prefill's handoff reaching the ingress to the decode replica
  holding the blocks (routing, the object-store fetch, decoding);
- `loraplex_disaggregated_requests{phase}`: requests of this ingress now in "prefill" (queued or
  running on a prefill replica), "transfer" and "decode";
- `loraplex_phase_requests_waiting{phase}` / `..._running{phase}`: the engines' queues, summed per phase.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

PHASES = ("prefill", "transfer", "decode")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVTransferMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.transfers = Counter(
            "loraplex_kv_transfers", "KV handoffs prefill -> decode", ["outcome"], registry=r
        )
        self.bytes = Counter("loraplex_kv_transfer_bytes", "KV bytes moved prefill -> decode", registry=r)
        self.seconds = Histogram(
            "loraplex_kv_transfer_seconds", "KV handoff time (ingress view)", buckets=_SECONDS, registry=r
        )
        self.phase = Gauge("loraplex_disaggregated_requests", "Requests by phase", ["phase"], registry=r)
        self.waiting = Gauge(
            "loraplex_phase_requests_waiting", "Engine queues by phase", ["phase"], registry=r
        )
        self.running = Gauge(
            "loraplex_phase_requests_running", "Running sequences by phase", ["phase"], registry=r
        )
        for p in PHASES:
            self.phase.labels(p).set(0)
        for outcome in ("ok", "failed", "timeout"):
            self.transfers.labels(outcome)
        self._bound: set[int] = set()

    def bind(self, registry: CollectorRegistry) -> None:
        """Export these metrics through `registry` too (once per registry)."""
        if id(registry) not in self._bound:
            registry.register(_Forward(self.registry))
            self._bound.add(id(registry))

    def refresh_phases(self, replicas: Iterable[dict[str, Any]]) -> None:
        """Engine queues per phase from the replicas' latest reports (`describe()` with "role")."""
        from api.engine_protocol import EngineStatsMsg, decode_from_engine

        totals = {"prefill": [0, 0], "decode": [0, 0]}
        for r in replicas:
            role = r.get("role")
            if role in totals and r.get("stats"):
                st = decode_from_engine(r["stats"])
                if isinstance(st, EngineStatsMsg):
                    totals[role][0] += int(st.engine.get("num_waiting", 0))
                    totals[role][1] += int(st.engine.get("num_running", 0))
        for role, (waiting, running) in totals.items():
            self.waiting.labels(role).set(waiting)
            self.running.labels(role).set(running)


class _Forward:
    """A collector that yields another registry's metrics."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()
