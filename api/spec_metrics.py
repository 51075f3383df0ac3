"""Prometheus metrics of speculative decoding, from the engine's cumulative per-adapter totals.

    loraplex_spec_proposed_tokens_total{adapter}   proposed tokens the target verified
    loraplex_spec_accepted_tokens_total{adapter}   of which it accepted
    loraplex_spec_verifications_total{adapter}     sequence-steps that verified at least one proposal
    loraplex_spec_mean_acceptance_length{adapter}  tokens emitted per verification: 1 + accepted/verified

`adapter` is the adapter name, "" for the base model. The engine reports running totals; the counters
advance by the difference since the last refresh (a restarted engine starts again from zero).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge


class SpecMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.proposed = Counter(
            "loraplex_spec_proposed_tokens",
            "Speculative tokens proposed and verified",
            ["adapter"],
            registry=r,
        )
        self.accepted = Counter(
            "loraplex_spec_accepted_tokens",
            "Speculative tokens accepted by the target",
            ["adapter"],
            registry=r,
        )
        self.verifications = Counter(
            "loraplex_spec_verifications",
            "Sequence-steps that verified speculative tokens",
            ["adapter"],
            registry=r,
        )
        self.mean_length = Gauge(
            "loraplex_spec_mean_acceptance_length",
            "Tokens emitted per speculative verification (1 + accepted per verification)",
            ["adapter"],
            registry=r,
        )
        self._last: dict[str, tuple[int, int, int]] = {}

    def refresh(self, engine_stats: dict[str, Any]) -> None:
        """Advance the counters to the engine's totals (`spec_by_adapter`: name -> [proposed, accepted,
        verifications])."""
        for name, (proposed, accepted, verified) in (engine_stats.get("spec_by_adapter") or {}).items():
            last = self._last.get(name, (0, 0, 0))
            if proposed < last[0] or accepted < last[1] or verified < last[2]:
                last = (0, 0, 0)  # the engine restarted: its totals began again
            self.proposed.labels(name).inc(proposed - last[0])
            self.accepted.labels(name).inc(accepted - last[1])
            self.verifications.labels(name).inc(verified - last[2])
            if verified:
                self.mean_length.labels(name).set(1 + accepted / verified)
            self._last[name] = (proposed, accepted, verified)
