"""What the LoRA manager reports: each known adapter (`LoRAInfo`: tier, rank, pin, device footprint)
and the adapter pool's occupancy and counters (`LoRAPoolStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.lora.loader import AdapterLoader
from engine.lora.pool import ResidentAdapter
from engine.lora.residency import AdapterResidency


@dataclass(slots=True)
class LoRAInfo:
    """One known adapter as `list_loras` reports it."""

    digest: str
    names: list[str]
    tier: str  # "device" | "cpu" | "loading" | "disk"
    rank: int | None
    pinned: bool
    pages: int
    memory_bytes: int = 0  # device bytes of its pages (projections and MoE experts); 0 when not resident


@dataclass(slots=True)
class LoRAPoolStats:
    pages_total: int
    pages_used: int
    pages_free: int
    resident: int
    cpu_cached: int
    loads: int
    device_uploads: int
    evictions: int
    load_failures: int
    load_seconds_total: float
    last_load_seconds: float
    side_bytes_used: int = 0  # device bytes resident adapters keep beside their pages
    side_bytes_budget: int = 0


def _device_rank(dev: ResidentAdapter) -> int:
    """The largest rank of a resident adapter, over its projections and its experts."""
    ranks = [r for layer in dev.layer_ranks for r in layer]
    if dev.experts is not None:
        ranks += [r for layer in dev.experts.ranks for r in layer.values()]
    return max(ranks, default=0)


def adapter_infos(loader: AdapterLoader, residency: AdapterResidency) -> list[LoRAInfo]:
    """Every adapter `loader` knows, in its order: the tier it is in ("device" when resident, "cpu" with
    a host copy, "loading" while a background load runs, else "disk"), its largest rank (None while only
    on disk), whether it is pinned, and its device pages and bytes."""
    out = []
    res = residency
    for digest in loader.known_digests():
        dev = res.pool.resident.get(digest)
        ckpt = res.host_copy(digest) if dev is None else None
        if dev is not None:
            tier = "device"
        elif ckpt is not None:
            tier = "cpu"
        elif loader.is_loading(digest):
            tier = "loading"
        else:
            tier = "disk"
        rank = _device_rank(dev) if dev else (ckpt.rank if ckpt else None)
        pinned = digest in res.pinned
        names = loader.names_of(digest)
        pages, memory = (dev.num_pages, dev.memory_bytes) if dev else (0, 0)
        out.append(LoRAInfo(digest, names, tier, rank, pinned, pages, memory))
    return out


def pool_stats(loader: AdapterLoader, residency: AdapterResidency) -> LoRAPoolStats:
    """The adapter pool's pages (total, used, free), adapters resident and cached on the host, and the
    load, upload, eviction and failure counters with load times."""
    pool, load, res = residency.pool, loader.stats, residency.stats
    used, total = pool.pages_used(), pool.pages_total()
    return LoRAPoolStats(
        pages_total=total,
        pages_used=used,
        pages_free=total - used,
        resident=len(pool.resident),
        cpu_cached=len(residency.cpu),
        loads=load.loads,
        device_uploads=res.device_uploads,
        evictions=res.evictions,
        load_failures=load.failures,
        load_seconds_total=load.seconds_total,
        last_load_seconds=load.last_seconds,
        side_bytes_used=pool.side_used,
        side_bytes_budget=pool.side_budget,
    )
