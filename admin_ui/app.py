"""Wire the admin UI into the API's FastAPI app: routers, static files, error handlers, templates."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from admin_ui.session import CsrfRejected, LoginRequired, login_url
from admin_ui.templating import make_templates, security_headers

STATIC_DIR = Path(__file__).parent / "static"


def mount_admin_ui(app: FastAPI) -> None:
    """Add `/admin` pages, `/admin/static`, and the handlers that turn session/CSRF failures into
    a redirect to the login form (401 for JSON endpoints) and a 403 page."""
    from admin_ui.routes import adapter_detail, adapters, auth, dashboard, keys, playground, pool, usage

    app.state.admin_ui_templates = make_templates()
    for module in (auth, dashboard, adapters, adapter_detail, pool, playground, keys, usage):
        app.include_router(module.router)
    app.mount("/admin/static", StaticFiles(directory=str(STATIC_DIR)), name="admin_static")
    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(CsrfRejected, _csrf_rejected)


async def _login_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    if exc.wants_html:
        return RedirectResponse(login_url(exc.next_path), status_code=303)
    return JSONResponse({"error": {"message": "admin session required; log in at /admin/login"}}, 401)


async def _csrf_rejected(request: Request, exc: Exception) -> Response:
    message = str(exc) or "missing or wrong CSRF token"
    if "text/html" not in request.headers.get("accept", ""):
        return JSONResponse({"error": {"message": message}}, status_code=403)
    templates = request.app.state.admin_ui_templates
    response = templates.TemplateResponse(
        request,
        "error.html",
        {"title": "Request refused", "message": message, "csrf_token": None, "active": None, "flash": None},
        status_code=403,
    )
    security_headers(response)
    return response
