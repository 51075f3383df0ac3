"""`/admin/usage`: tokens per adapter and per API key over time; `/admin/adapters/{name}/limits`: the
adapter page's rate-limit form (a CSRF-checked POST that redirects back with a flash message)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from admin_ui.session import CsrfSession, Session
from admin_ui.templating import flash, render
from admin_ui.usage_page import RANGES, bucket_starts, usage_range, usage_view
from api.deps import StateDep
from api.errors import APIError
from api.routes.admin_api import call_registry, read_registry
from lora_registry.limits import LIMIT_FIELDS, MAX_LIMIT

router = APIRouter(prefix="/admin", include_in_schema=False)


@router.get("/usage")
async def usage_page(request: Request, state: StateDep, session: Session, range: str = "24h") -> Response:
    """Charts of total tokens per hour (or day) by adapter and by key, with the range's totals."""
    choice = range if range in RANGES else "24h"
    start, end, bucket = usage_range(choice)
    starts = bucket_starts(start, end, bucket)
    views = []
    for by in ("adapter", "key"):
        series = await read_registry(state, state.registry.usage.summary, by, start, end, bucket)
        totals = await read_registry(state, state.registry.usage.summary, by, start, end)
        views.append(usage_view(series, totals, starts))
    context = {"title": "Usage", "views": views, "range": choice, "ranges": list(RANGES), "start": start}
    return render(request, "usage.html", context, session, active="usage")


@router.post("/adapters/{name}/limits")
async def set_limits(name: str, request: Request, state: StateDep, _: CsrfSession) -> Response:
    """Set the adapter's three limits from the form (an empty field or 0 means no limit)."""
    form = await request.form()
    values: dict[str, int] = {}
    for field in LIMIT_FIELDS:
        raw = str(form.get(field) or "").strip()
        if raw and (not raw.isdigit() or int(raw) > MAX_LIMIT):
            return _back(
                request, name, f"{field.replace('_', ' ')}: a whole number from 0 to {MAX_LIMIT}", "error"
            )
        values[field] = int(raw) if raw else 0
    try:
        await call_registry(state, state.registry.limits.set, "adapter", name, actor="admin-ui", **values)
    except APIError as exc:
        return _back(request, name, exc.message, "error")
    return _back(request, name, f"Limits of {name} saved.")


def _back(request: Request, name: str, text: str, kind: str = "ok") -> Response:
    response = RedirectResponse(f"/admin/adapters/{name}", status_code=303)
    flash(request, response, text, kind)
    return response
