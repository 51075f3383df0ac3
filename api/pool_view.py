"""Each engine replica's pool as `GET /admin/api/pool` and the admin UI's pool page show it.

Behind `loraplex serve --replicas N` the ingress's client keeps every replica's latest statistics
(`RemoteEngineClient.replica_stats()`, the same reports the per-replica `vllm:*` gauges are set from);
the single server has one engine, shown as one replica with the id `local`. Per replica: health, queue
(waiting, running), KV cache use and prefix-cache counters, adapter pool pages and counters, and every
adapter it holds by tier (named by the active name that points at its digest, if any).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LOCAL = "local"  # the single server's one engine
TIER_ORDER = ("device", "loading", "cpu", "disk")


@dataclass(slots=True)
class ReplicaPool:
    """One engine replica's pool and queue, from its latest statistics."""

    replica: str
    healthy: bool
    reported: bool = True  # False: the replica is up but its engine has sent no statistics yet
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached_free: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    lora: dict[str, Any] | None = None  # pages used/free/total, resident, loads, evictions, uploads
    adapters: list[dict[str, Any]] = field(default_factory=list)  # by tier, then name
    tier_counts: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float | None:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"prefix_hit_rate": self.prefix_hit_rate}


def replica_pools(client: Any, names_by_digest: dict[str, str]) -> list[ReplicaPool]:
    """Every replica's pool, sorted by replica id: behind `--replicas` every live replica the ingress
    polled (`client.replicas`) with its statistics from `client.replica_stats()` (none yet: `reported`
    False), else the one engine's `client.stats` (an empty list before the first report)."""
    if hasattr(client, "replica_stats"):
        stats = dict(client.replica_stats())
        parts = [(r["replica"], stats.get(r["replica"]), bool(r.get("healthy"))) for r in client.replicas]
    else:
        parts = [(LOCAL, client.stats, bool(client.healthy))] if client.stats is not None else []
    pools = [_pool(rid, stats, ok, names_by_digest) for rid, stats, ok in parts]
    return sorted(pools, key=lambda p: p.replica)


def _pool(replica: str, stats: Any, healthy: bool, names_by_digest: dict[str, str]) -> ReplicaPool:
    if stats is None:
        return ReplicaPool(replica, healthy, reported=False, tier_counts=dict.fromkeys(TIER_ORDER, 0))
    e = stats.engine
    adapters = []
    for a in stats.adapters:
        active = names_by_digest.get(a["digest"])
        label = active or ", ".join(a.get("names") or ()) or a["digest"][:12]
        adapters.append(a | {"active_name": active, "label": label})
    adapters.sort(key=lambda a: (_tier_rank(a.get("tier")), a["label"]))
    counts = {t: sum(1 for a in adapters if a.get("tier") == t) for t in TIER_ORDER}
    return ReplicaPool(
        replica=replica,
        healthy=healthy,
        num_waiting=int(e.get("num_waiting", 0)),
        num_running=int(e.get("num_running", 0)),
        kv_usage=float(e.get("kv_usage", 0.0)),
        kv_blocks_used=int(e.get("kv_blocks_used", 0)),
        kv_blocks_total=int(e.get("kv_blocks_total", 0)),
        kv_blocks_cached_free=int(e.get("kv_blocks_cached_free", 0)),
        prefix_cache_queries=int(e.get("prefix_cache_queries", 0)),
        prefix_cache_hits=int(e.get("prefix_cache_hits", 0)),
        lora=dict(stats.lora) if stats.lora is not None else None,
        adapters=adapters,
        tier_counts=counts,
    )


def _tier_rank(tier: str | None) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)
