"""`/admin/pool`: every engine replica's adapter pool (residency by adapter and tier), KV use and queue.

The same per-replica reports as `GET /admin/api/pool`'s `replicas` (`api.pool_view`); the single server
shows its one engine as replica `local`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from admin_ui.page_data import TIER_LABELS, TIER_ORDER
from admin_ui.session import Session
from admin_ui.templating import render
from api.deps import StateDep
from api.pool_view import replica_pools

router = APIRouter(prefix="/admin", include_in_schema=False)


@router.get("/pool")
async def pool_page(request: Request, state: StateDep, session: Session) -> Response:
    """One section per replica: health, queue, KV cache, prefix hits, pool pages, adapters by tier."""
    names = {a.digest: a.name for a in state.follower.snapshot().values()}
    context = {
        "title": "Pool",
        "pools": replica_pools(state.client, names),
        "cluster": hasattr(state.client, "replica_stats"),
        "tiers": [(t, TIER_LABELS[t]) for t in TIER_ORDER],
    }
    return render(request, "pool.html", context, session, active="pool")
