"""The affinity router's counters and hot-adapter placements, for the rest of its process (the ingress).

Ray builds the router inside the process that holds the engine deployment's handle (an ingress replica),
out of loraplex's reach; the router publishes here what the ingress needs from it:
- `RouterCollector`: Prometheus families for the ingress's `/metrics` (requests routed and prompt tokens
  predicted cached, per replica; spreads, contractions and rebalances per adapter; replicas per adapter);
- `protected()`: per replica, the digests of the hot adapters spread there, which the ingress sends
  along with each request so that replicas keep those adapters' pages (`api.cluster.replica`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from api.cluster.placement import Placements


@dataclass(slots=True)
class RouterStats:
    placements: Placements
    routed: dict[str, int] = field(default_factory=dict)  # replica -> requests routed there
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # replica -> prompt tokens routed there
    predicted_cached: dict[str, int] = field(default_factory=dict)  # replica -> of which predicted cached
    protected: dict[str, list[str]] = field(default_factory=dict)  # replica -> hot adapters' digests

    def routed_to(self, replica: str, prompt_tokens: int, predicted_cached: int) -> None:
        """Count one request routed to `replica`."""
        for counts, n in ((self.routed, 1), (self.prompt_tokens, prompt_tokens)):
            counts[replica] = counts.get(replica, 0) + n
        self.predicted_cached[replica] = self.predicted_cached.get(replica, 0) + predicted_cached


class _Current:
    stats: RouterStats | None = None


def publish(stats: RouterStats) -> None:
    """Make `stats` this process's router statistics (the router calls it once, when Ray builds it)."""
    _Current.stats = stats


def current() -> RouterStats | None:
    return _Current.stats


def protected() -> dict[str, list[str]]:
    """Per replica, the digests of the hot adapters placed there (empty without an affinity router)."""
    stats = _Current.stats
    return dict(stats.protected) if stats is not None else {}


def _copy(d: dict) -> dict:
    """A copy of a dict the router's thread may be changing meanwhile."""
    for _ in range(10):
        try:
            return dict(d)
        except RuntimeError:
            continue
    return {}


def _counters(label: str, rows: Iterable[tuple[str, str, dict]]) -> Iterator[CounterMetricFamily]:
    """One counter family per (name, doc, counts) row, a sample per key of `counts` (a snapshot of it,
    sorted) under the label `label`."""
    for name, doc, counts in rows:
        family = CounterMetricFamily(name, doc, labels=[label])
        for key, n in sorted(_copy(counts).items()):
            family.add_metric([key], n)
        yield family


class RouterCollector(Collector):
    """The router's families for `/metrics` (nothing until Ray has built the router)."""

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = _Current.stats
        if stats is None:
            return
        per_replica = (
            ("loraplex_router_requests", "Requests the affinity router sent to each replica", stats.routed),
            ("loraplex_router_prompt_tokens", "Prompt tokens routed to each replica", stats.prompt_tokens),
            (
                "loraplex_router_predicted_cached_tokens",
                "Prompt tokens the router predicted in the chosen replica's prefix cache",
                stats.predicted_cached,
            ),
        )
        yield from _counters("replica", per_replica)
        events = stats.placements.events
        per_adapter = (
            ("loraplex_router_adapter_spreads", "Hot adapters spread to one more replica", events.spreads),
            (
                "loraplex_router_adapter_contractions",
                "Adapters contracted off a replica",
                events.contractions,
            ),
            (
                "loraplex_router_adapter_rebalances",
                "Adapters moved to a less loaded replica",
                events.rebalances,
            ),
        )
        yield from _counters("adapter", per_adapter)
        gauge = GaugeMetricFamily(
            "loraplex_router_adapter_replicas", "Replicas each adapter is placed on now", labels=["adapter"]
        )
        for adapter, n in sorted(stats.placements.spread_of().items()):
            gauge.add_metric([adapter], n)
        yield gauge
