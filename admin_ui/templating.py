"""Jinja2 rendering of the admin pages: shared context (session CSRF token, nav, flash message)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request, Response
from fastapi.templating import Jinja2Templates
from itsdangerous import BadSignature, SignatureExpired
from starlette.responses import HTMLResponse

from admin_ui.formatting import FILTERS
from admin_ui.session import COOKIE_PATH, AdminSession
from admin_ui.state import ui_state
from api.state import app_state

TEMPLATES_DIR = Path(__file__).parent / "templates"
FLASH_COOKIE = "loraplex_admin_flash"
NAV = (
    ("dashboard", "/admin", "Dashboard"),
    ("adapters", "/admin/adapters", "Adapters"),
    ("pool", "/admin/pool", "Pool"),
    ("playground", "/admin/playground", "Playground"),
    ("keys", "/admin/keys", "API keys"),
    ("usage", "/admin/usage", "Usage"),
)


CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)


def security_headers(response: Response) -> None:
    """No caching, no framing, no inline scripts or styles, no sniffing, no cross-site referrers."""
    response.headers["Cache-Control"] = "no-store"
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"


def make_templates() -> Jinja2Templates:
    """The admin UI's template environment (autoescaping on, our filters installed)."""
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
    templates.env.filters.update(FILTERS)
    templates.env.globals["nav_items"] = NAV
    return templates


def flash(request: Request, response: Response, text: str, kind: str = "ok") -> None:
    """Show `text` once, on the next page this browser renders (a short-lived signed cookie)."""
    value = ui_state(request).signer.dumps([kind, text], salt="flash")
    response.set_cookie(FLASH_COOKIE, value, max_age=120, path=COOKIE_PATH, httponly=True, samesite="strict")


def _pop_flash(request: Request) -> tuple[str, str] | None:
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return None
    try:
        kind, text = ui_state(request).signer.loads(raw, max_age=120, salt="flash")
    except (BadSignature, SignatureExpired, ValueError, TypeError):
        return None
    return str(kind), str(text)


def render(
    request: Request,
    template: str,
    context: dict[str, Any],
    session: AdminSession | None,
    *,
    active: str | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    """Render `template` with the common context; consumes the pending flash message."""
    templates: Jinja2Templates = request.app.state.admin_ui_templates
    core = app_state(request)
    message = _pop_flash(request)
    ctx = {
        "csrf_token": session.csrf if session else None,
        "active": active,
        "flash": message,
        "served_model": core.settings.served_model_name,
        **context,
    }
    response = templates.TemplateResponse(request, template, ctx, status_code=status_code)
    security_headers(response)
    if message is not None:
        response.delete_cookie(FLASH_COOKIE, path=COOKIE_PATH)
    return response
