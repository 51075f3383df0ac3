"""`/admin/login` (form field `token`) and `/admin/logout`."""

from __future__ import annotations

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
from admin_ui.templating import flash, render
from api.deps import StateDep

router = APIRouter(prefix="/admin", include_in_schema=False)


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
    if await read_session(request) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return _login_page(request, next)


@router.post("/login")
async def login(request: Request, state: StateDep) -> Response:
    """Check the admin token (through the per-client `AuthThrottle`, shared with the admin API: a
    guessing client is slowed down, the right token still works); on success start a session."""
    await check_login_csrf(request)
    form = await request.form()
    next_path = str(form.get("next") or "/admin")
    token = str(form.get("token") or "")
    client = request.client.host if request.client else "?"
    ok = await state.auth_throttle.check(client, lambda: state.admin_auth.check(token))
    if ok is None:
        return _login_page(request, next_path, "Too many failed attempts; wait a moment and retry.", 429)
    if not ok:
        message = "Enter the admin token." if not token else "That is not the admin token."
        return _login_page(request, next_path, message, 401)
    response = RedirectResponse(safe_next(next_path), status_code=303)
    await start_session(request, response)
    return response


@router.post("/logout")
async def logout(request: Request, session: CsrfSession) -> Response:
    """End the session (revoked server-side too) and return to the login form."""
    response = RedirectResponse("/admin/login", status_code=303)
    await end_session(request, response, session)
    flash(request, response, "You are logged out.")
    return response
