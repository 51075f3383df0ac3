"""`/admin/adapters/{name}`: versions, what the serving version contains (DoRA, LoRA bias, tokens added,
modules saved, device memory), activate / deactivate / roll back / delete, endpoint snippets, recent
traffic. Every action is a CSRF-checked POST that redirects back with a flash message."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from admin_ui.charts import traffic_chart
from admin_ui.page_data import adapter_series, engine_tiers
from admin_ui.session import CsrfSession, Session
from admin_ui.snippets import endpoint_snippets
from admin_ui.templating import flash, render
from api.adapter_contents import current_contents
from api.deps import AdaptersDep, StateDep
from api.errors import APIError
from api.routes.admin_api import call_registry, read_registry
from api.state import app_state

router = APIRouter(prefix="/admin/adapters", include_in_schema=False)


@router.get("/{name}")
async def detail_page(name: str, request: Request, state: StateDep, session: Session) -> Response:
    """One adapter: its versions, state, engine residency, endpoint and traffic."""
    try:
        detail = await read_registry(state, state.registry.adapters.show, name)
    except APIError as exc:
        ctx = {"title": "Not found", "message": exc.message}
        return render(request, "error.html", ctx, session, active="adapters", status_code=exc.status)
    a = detail.adapter
    base = str(request.base_url).rstrip("/")
    total = state.traffic.totals.get(name)
    context = {
        "title": name,
        "a": a,
        "versions": list(reversed(detail.versions)),
        "tiers": engine_tiers(state),
        "snippets": endpoint_snippets(base, name),
        "endpoint": f"{base}/v1/adapters/{name}",
        "chart": traffic_chart(
            *adapter_series(state, name), chart_id="adapter-traffic", width=380, height=170
        ),
        "requests": total.requests if total else 0,
        "tokens": total.tokens if total else 0,
        "last_used": state.traffic.last_used.get(name),
        "limits": await read_registry(state, state.registry.limits.get, "adapter", name),
        "contents": await current_contents(state, detail),
    }
    return render(request, "adapter_detail.html", context, session, active="adapters")


def _back(request: Request, name: str, text: str, kind: str = "ok") -> Response:
    response = RedirectResponse(f"/admin/adapters/{name}", status_code=303)
    flash(request, response, text, kind)
    return response


@router.post("/{name}/activate")
async def activate(name: str, request: Request, svc: AdaptersDep, _: CsrfSession) -> Response:
    try:
        info = await call_registry(app_state(request), svc.activate, name, actor="admin-ui")
    except APIError as exc:
        return _back(request, name, exc.message, "error")
    version = info.current.version if info.current else "?"
    return _back(request, name, f"{name} is active: version {version} is being served.")


@router.post("/{name}/deactivate")
async def deactivate(name: str, request: Request, svc: AdaptersDep, _: CsrfSession) -> Response:
    try:
        await call_registry(app_state(request), svc.deactivate, name, actor="admin-ui")
    except APIError as exc:
        return _back(request, name, exc.message, "error")
    return _back(request, name, f"{name} is inactive: its endpoint answers 404 until it is activated.")


@router.post("/{name}/rollback")
async def rollback(name: str, request: Request, svc: AdaptersDep, _: CsrfSession) -> Response:
    raw = str((await request.form()).get("version") or "")
    if not raw.isdigit() or int(raw) < 1:
        return _back(request, name, "choose a version to roll back to", "error")
    try:
        await call_registry(app_state(request), svc.rollback, name, int(raw), actor="admin-ui")
    except APIError as exc:
        return _back(request, name, exc.message, "error")
    return _back(request, name, f"{name} now points at version {raw}.")


@router.post("/{name}/delete")
async def delete(name: str, request: Request, svc: AdaptersDep, _: CsrfSession) -> Response:
    """Delete the adapter and all its versions, once its name has been typed to confirm."""
    if str((await request.form()).get("confirm") or "").strip() != name:
        return _back(request, name, f"type {name} in the confirmation box to delete it", "error")
    try:
        await call_registry(app_state(request), svc.delete, name, actor="admin-ui")
    except APIError as exc:
        return _back(request, name, exc.message, "error")
    response = RedirectResponse("/admin/adapters", status_code=303)
    flash(request, response, f"Deleted {name} and all its versions.")
    return response
