"""`/admin/login` (form field `token`) and `/admin/logout`."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from admin_ui.session import (
    CsrfSession,
    check_login_csrf,
    end_session,
    login_csrf,
    read_session,
    safe_next,
    set_login_csrf,
    start_session,
)
from admin_ui.state import ui_state
from admin_ui.templating import flash, render
from api.deps import StateDep

router = APIRouter(prefix="/admin", include_in_schema=False)
MAX_FAILURES, FAILURE_WINDOW = 10, 60.0


def _login_page(request: Request, next_path: str, error: str | None = None, status: int = 200) -> Response:
    token = login_csrf(request)
    response = render(
        request,
        "login.html",
        {"login_csrf": token, "next": safe_next(next_path), "error": error, "title": "Log in"},
        None,
        status_code=status,
    )
    set_login_csrf(request, response, token)
    return response


@router.get("/login")
async def login_form(request: Request, next: str = "/admin") -> Response:
    """The login form (already logged in: straight on to `next`)."""
    if read_session(request) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return _login_page(request, next)


def _throttled(request: Request) -> bool:
    """True after `MAX_FAILURES` wrong tokens from this client within `FAILURE_WINDOW` seconds."""
    ui = ui_state(request)
    client = request.client.host if request.client else "?"
    now = time.monotonic()
    recent = [t for t in ui.login_failures.get(client, []) if now - t < FAILURE_WINDOW]
    ui.login_failures[client] = recent
    return len(recent) >= MAX_FAILURES


def _record_failure(request: Request) -> None:
    client = request.client.host if request.client else "?"
    ui_state(request).login_failures.setdefault(client, []).append(time.monotonic())


@router.post("/login")
async def login(request: Request, state: StateDep) -> Response:
    """Check the admin token; on success start a session and go to `next`."""
    await check_login_csrf(request)
    form = await request.form()
    next_path = str(form.get("next") or "/admin")
    if _throttled(request):
        return _login_page(request, next_path, "Too many failed attempts; wait a minute and retry.", 429)
    token = str(form.get("token") or "")
    if not state.admin_auth.check(token):
        _record_failure(request)
        message = "Enter the admin token." if not token else "That is not the admin token."
        return _login_page(request, next_path, message, 401)
    response = RedirectResponse(safe_next(next_path), status_code=303)
    start_session(request, response)
    return response


@router.post("/logout")
async def logout(request: Request, session: CsrfSession) -> Response:
    """End the session (revoked server-side too) and return to the login form."""
    response = RedirectResponse("/admin/login", status_code=303)
    end_session(request, response, session)
    flash(request, response, "You are logged out.")
    return response
