"""What the pages show, gathered from the registry, the engine's statistics and the traffic log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from admin_ui.charts import traffic_chart
from admin_ui.rates import RateMeter
from lora_registry.schemas import AdapterInfo

TIER_ORDER = ("device", "loading", "cpu", "disk")
TIER_LABELS = {"device": "Device pages", "loading": "Loading", "cpu": "CPU cache", "disk": "Disk only"}


@dataclass(slots=True)
class AdapterRow:
    """One line of the adapters table."""

    name: str
    description: str
    status: str
    version: int | None
    rank: int | None
    target_modules: tuple[str, ...]
    size_bytes: int | None
    num_versions: int
    last_used: float | None
    requests: int
    tokens: int
    tier: str | None  # where the engine holds the active version: device / cpu / loading / disk


def engine_tiers(state: Any) -> dict[str, dict[str, Any]]:
    """Engine adapter entries (tier, pages, pinned, rank) by content digest."""
    stats = state.client.stats
    return {a["digest"]: a for a in (stats.adapters if stats is not None else [])}


def adapter_rows(state: Any, infos: list[AdapterInfo]) -> list[AdapterRow]:
    """Registry adapters joined with their traffic totals and engine residency."""
    tiers = engine_tiers(state)
    traffic = state.traffic
    rows = []
    for a in infos:
        cur = a.current
        total = traffic.totals.get(a.name)
        entry = tiers.get(cur.digest) if cur is not None else None
        rows.append(
            AdapterRow(
                name=a.name,
                description=a.description,
                status=a.status,
                version=cur.version if cur else None,
                rank=cur.rank if cur else None,
                target_modules=cur.target_modules if cur else (),
                size_bytes=cur.size_bytes if cur else None,
                num_versions=a.num_versions,
                last_used=traffic.last_used.get(a.name),
                requests=total.requests if total else 0,
                tokens=total.tokens if total else 0,
                tier=entry["tier"] if entry else None,
            )
        )
    return rows


def filter_rows(rows: list[AdapterRow], query: str, status: str) -> list[AdapterRow]:
    """Rows whose name, description or target modules contain `query`, with `status` ('' = any)."""
    q = query.strip().lower()

    def hit(r: AdapterRow) -> bool:
        text = " ".join((r.name, r.description, *r.target_modules)).lower()
        return (not q or q in text) and (not status or r.status == status)

    return [r for r in rows if hit(r)]


@dataclass(slots=True)
class Dashboard:
    """Everything the dashboard shows; `to_json()` is what its poll endpoint returns."""

    base_model: str
    model_path: str
    healthy: bool
    restarts: int
    info: dict[str, Any]
    engine: dict[str, Any]
    lora: dict[str, Any] | None
    residency: list[dict[str, Any]]
    tier_counts: dict[str, int]
    requests_per_s: float | None
    tokens_per_s: float | None
    total_requests: int
    in_flight: int
    series: tuple[list[int], dict[str, list[int]]] = field(default_factory=lambda: ([], {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "restarts": self.restarts,
            "engine": self.engine,
            "lora": self.lora,
            "residency": self.residency,
            "tier_counts": self.tier_counts,
            "requests_per_s": self.requests_per_s,
            "tokens_per_s": self.tokens_per_s,
            "total_requests": self.total_requests,
            "in_flight": self.in_flight,
            "chart_svg": str(traffic_chart(*self.series)),
        }


def dashboard(state: Any, meter: RateMeter, minutes: int = 15) -> Dashboard:
    """A snapshot of the server for the dashboard (samples the rate meter once)."""
    client = state.client
    stats = client.stats
    engine = dict(stats.engine) if stats is not None else {}
    lora = dict(stats.lora) if stats is not None and stats.lora is not None else None
    names_by_digest = {a.digest: a.name for a in state.follower.snapshot().values()}
    residency = []
    for a in stats.adapters if stats is not None else []:
        name = names_by_digest.get(a["digest"]) or ", ".join(a["names"]) or a["digest"][:12]
        residency.append(
            {
                "name": name,
                "digest": a["digest"],
                "tier": a["tier"],
                "rank": a["rank"],
                "pages": a["pages"],
                "pinned": a["pinned"],
                "active": a["digest"] in names_by_digest,
            }
        )
    residency.sort(key=lambda r: (TIER_ORDER.index(r["tier"]) if r["tier"] in TIER_ORDER else 9, r["name"]))
    counts = {t: sum(1 for r in residency if r["tier"] == t) for t in TIER_ORDER}
    total_requests = sum(b.requests for b in state.traffic.totals.values())
    tokens = int(engine.get("generation_tokens_total", 0))
    rates = meter.observe(total_requests, tokens)
    engine.setdefault("prefix_hit_rate", _hit_rate(engine))
    info = msgspec.structs.asdict(client.info) if client.info is not None else {}
    return Dashboard(
        base_model=state.settings.served_model_name,
        model_path=str(state.settings.model),
        healthy=client.healthy,
        restarts=client.restarts,
        info=info,
        engine=engine,
        lora=lora,
        residency=residency,
        tier_counts=counts,
        requests_per_s=rates.requests_per_s,
        tokens_per_s=rates.tokens_per_s,
        total_requests=total_requests,
        in_flight=client.num_in_flight(),
        series=state.traffic.series(minutes),
    )


def _hit_rate(engine: dict[str, Any]) -> float | None:
    queries = engine.get("prefix_cache_queries") or 0
    return (engine.get("prefix_cache_hits") or 0) / queries if queries else None


def adapter_series(state: Any, name: str, minutes: int = 30) -> tuple[list[int], dict[str, list[int]]]:
    """The traffic series of one adapter (empty when it had no requests in the window)."""
    starts, data = state.traffic.series(minutes)
    return starts, ({name: data[name]} if name in data else {})
