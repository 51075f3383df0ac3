"""`/admin`: the dashboard, and `/admin/dashboard.json`, which its script polls to stay live."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from admin_ui.charts import traffic_chart
from admin_ui.page_data import TIER_LABELS, TIER_ORDER, dashboard
from admin_ui.session import Session
from admin_ui.state import UiStateDep
from admin_ui.templating import render
from api.deps import StateDep

router = APIRouter(prefix="/admin", include_in_schema=False)
POLL_MS = 2000


@router.get("")
async def dashboard_page(request: Request, state: StateDep, ui: UiStateDep, session: Session) -> Response:
    """Base model, engine and pool statistics, residency by tier, throughput and the traffic chart."""
    snap = dashboard(state, ui.rates)
    context = {
        "title": "Dashboard",
        "d": snap,
        "chart": traffic_chart(*snap.series),
        "tiers": [(t, TIER_LABELS[t]) for t in TIER_ORDER],
        "poll_ms": POLL_MS,
    }
    return render(request, "dashboard.html", context, session, active="dashboard")


@router.get("/dashboard.json")
async def dashboard_json(state: StateDep, ui: UiStateDep, _: Session) -> JSONResponse:
    """The dashboard's live numbers, residency rows and the chart (as SVG markup)."""
    snap = dashboard(state, ui.rates)
    return JSONResponse(snap.to_json(), headers={"Cache-Control": "no-store"})
