"""`/admin/keys`: list API keys, create one (its secret shown once, on the response page), revoke."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from admin_ui.session import AdminSession, CsrfSession, Session
from admin_ui.templating import flash, render
from api.deps import KeysDep
from api.errors import APIError
from api.routes.admin_api import call_registry, read_registry
from api.state import app_state

router = APIRouter(prefix="/admin/keys", include_in_schema=False)


async def _page(
    request: Request,
    session: AdminSession,
    *,
    created: object | None = None,
    errors: list[str] | None = None,
    form: dict | None = None,
    status_code: int = 200,
) -> Response:
    state = app_state(request)
    keys = await read_registry(state, state.registry.keys.list)
    adapters = [a.name for a in await read_registry(state, state.registry.adapters.list)]
    context = {
        "title": "API keys",
        "keys": keys,
        "adapters": adapters,
        "created": created,
        "errors": errors or [],
        "form": form or {"scope": "adapters", "adapters": []},
        "require_api_key": state.settings.require_api_key,
    }
    return render(request, "keys.html", context, session, active="keys", status_code=status_code)


@router.get("")
async def keys_page(request: Request, session: Session) -> Response:
    return await _page(request, session)


@router.post("")
async def create_key(request: Request, keys: KeysDep, session: CsrfSession) -> Response:
    """Create a key scoped to everything ("admin") or to the chosen adapters; show its secret once."""
    form = await request.form()
    name = str(form.get("name") or "").strip()
    scope = str(form.get("scope") or "adapters")
    chosen = [str(a) for a in form.getlist("adapters")]
    echo = {"name": name, "scope": scope, "adapters": chosen}
    errors = []
    if not name:
        errors.append("enter a name for the key")
    if scope == "adapters" and not chosen:
        errors.append("choose at least one adapter, or give the key access to everything")
    if not errors:
        try:
            created = await call_registry(
                app_state(request),
                keys.create,
                name,
                admin=scope == "admin",
                adapters=[] if scope == "admin" else chosen,
                actor="admin-ui",
            )
        except APIError as exc:
            errors.append(exc.message)
        else:
            return await _page(request, session, created=created, status_code=201)
    return await _page(request, session, errors=errors, form=echo, status_code=400)


@router.post("/{name}/revoke")
async def revoke_key(name: str, request: Request, keys: KeysDep, _: CsrfSession) -> Response:
    response = RedirectResponse("/admin/keys", status_code=303)
    try:
        await call_registry(app_state(request), keys.revoke, name, actor="admin-ui")
    except APIError as exc:
        flash(request, response, exc.message, "error")
        return response
    flash(request, response, f"Revoked key {name}; it stops working at once.")
    return response
