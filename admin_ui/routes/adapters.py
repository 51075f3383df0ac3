"""`/admin/adapters`: the adapters table with search and filter, and the upload form's endpoint.

The upload works as a plain multipart form (303 to the new adapter, or the page again with the
validator's messages) and, driven by `upload.js`, as XMLHttpRequest with progress (JSON answers).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.datastructures import UploadFile

from admin_ui.page_data import adapter_rows, filter_rows
from admin_ui.session import AdminSession, CsrfSession, Session
from admin_ui.templating import flash, render
from api.deps import StateDep
from api.errors import APIError
from api.routes.admin_api import read_registry, register_upload
from api.state import app_state

router = APIRouter(prefix="/admin", include_in_schema=False)
STATUSES = ("active", "inactive")


async def _page(
    request: Request,
    session: AdminSession,
    *,
    errors: list[str] | None = None,
    form: dict[str, str] | None = None,
    status_code: int = 200,
) -> Response:
    state = app_state(request)
    infos = await read_registry(state, state.registry.adapters.list)
    rows = adapter_rows(state, infos)
    query = request.query_params.get("q", "")
    status = request.query_params.get("status", "")
    status = status if status in STATUSES else ""
    context = {
        "title": "Adapters",
        "rows": filter_rows(rows, query, status),
        "total": len(rows),
        "q": query,
        "status": status,
        "statuses": STATUSES,
        "errors": errors or [],
        "form": form or {},
        "max_upload": state.settings.max_upload_bytes,
    }
    return render(request, "adapters.html", context, session, active="adapters", status_code=status_code)


@router.get("/adapters")
async def adapters_page(request: Request, session: Session) -> Response:
    """Every adapter with status, version, rank, targets, size, last use and request count."""
    return await _page(request, session)


def _messages(exc: APIError) -> list[str]:
    """The registry's refusal as lines (temp paths are already removed by `register_upload`)."""
    return [line.strip() for line in exc.message.splitlines() if line.strip()] or ["the upload was refused"]


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


@router.post("/adapters")
async def upload(request: Request, state: StateDep, session: CsrfSession) -> Response:
    """Register an uploaded zip (or the two PEFT files) as a new version of `name`; maybe activate it."""
    form = await request.form()
    name = str(form.get("name") or "").strip()
    description = str(form.get("description") or "").strip() or None
    activate = str(form.get("activate") or "") in ("1", "on", "true", "yes")
    files = [f for f in form.getlist("file") if isinstance(f, UploadFile) and f.filename]
    echo = {"name": name, "description": description or "", "activate": "on" if activate else ""}
    try:
        if not name:
            raise APIError(400, "enter a name for the adapter", param="name")
        result = await register_upload(
            state, name, files, description=description, activate=activate, actor="admin-ui"
        )
    except APIError as exc:
        messages = _messages(exc)
        if _wants_json(request):
            return JSONResponse({"ok": False, "messages": messages, "field": exc.param}, exc.status)
        return await _page(request, session, errors=messages, form=echo, status_code=exc.status)
    v = result.version
    if result.created:
        text = f"Registered {name} version {v.version} (rank {v.rank}, digest {v.digest[:12]})"
    else:
        text = f"{name} already has this content as version {v.version}; nothing new was stored"
    if activate:
        text += " and activated it"
    target = f"/admin/adapters/{name}"
    if _wants_json(request):
        response: Response = JSONResponse(
            {"ok": True, "redirect": target, "message": text + ".", "created": result.created},
            201 if result.created else 200,
        )
    else:
        response = RedirectResponse(target, status_code=303)
    flash(request, response, text + ".")
    return response
