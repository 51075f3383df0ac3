"""The admin session: a signed, HttpOnly, SameSite=Strict cookie, and CSRF tokens bound to it.

Cookie value = itsdangerous-signed `{"sid", "csrf"}` with a timestamp (expires after `SESSION_SECONDS`).
The session itself lives in the registry database (`lora_registry.admin_sessions`): a cookie is a
session only while its row exists, unexpired and unrevoked, so logout holds after a restart and on
every replica.
Every state-changing request must present the session's `csrf` value, as the form field `csrf_token` or
the `X-CSRF-Token` header (compared in constant time). The login form, which has no session yet, uses a
double-submit token: a signed pre-session cookie whose value the form echoes.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import quote

from fastapi import Depends, Request, Response
from itsdangerous import BadSignature, SignatureExpired

from admin_ui.state import ui_state
from api.state import app_state

SESSION_COOKIE = "loraplex_admin_session"
LOGIN_CSRF_COOKIE = "loraplex_admin_login_csrf"
COOKIE_PATH = "/admin"
SESSION_SECONDS = 12 * 3600
LOGIN_CSRF_SECONDS = 3600
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


class LoginRequired(Exception):
    """No valid session: pages redirect to the login form, JSON endpoints answer 401."""

    def __init__(self, next_path: str, wants_html: bool) -> None:
        super().__init__("admin session required")
        self.next_path, self.wants_html = next_path, wants_html


class CsrfRejected(Exception):
    """A state-changing request without the right CSRF token (answered with 403)."""


@dataclass(slots=True, frozen=True)
class AdminSession:
    sid: str
    csrf: str
    issued_at: float


def _wants_html(request: Request) -> bool:
    """Browser navigations and plain form posts get a redirect; scripts (JSON, SSE) get a 401."""
    accept = request.headers.get("accept", "")
    if "text/html" in accept:
        return True
    return request.method == "GET" and "application/json" not in accept and "text/event-stream" not in accept


def safe_next(path: str | None) -> str:
    """`path` if it is a local admin path (no scheme, host or `//`), else the dashboard."""
    if not path or not path.startswith("/admin") or path.startswith("//") or "\\" in path:
        return "/admin"
    return path


def _cookie_kwargs(request: Request, max_age: int) -> dict:
    return dict(
        max_age=max_age,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def read_session(request: Request) -> AdminSession | None:
    """The request's valid, unrevoked session, or None (503 when the registry cannot be asked)."""
    raw = request.cookies.get(SESSION_COOKIE)
    if not raw:
        return None
    ui = ui_state(request)
    try:
        data, issued = ui.signer.loads(raw, max_age=SESSION_SECONDS, return_timestamp=True)
    except (BadSignature, SignatureExpired):
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("sid", "csrf")):
        return None
    core = app_state(request)
    if not await core.lookups.run(core.registry.admin_sessions.is_valid, data["sid"]):
        return None
    return AdminSession(data["sid"], data["csrf"], issued.timestamp())


async def require_session(request: Request) -> AdminSession:
    """Dependency: the admin session, or `LoginRequired` (redirect to the login form)."""
    session = await read_session(request)
    if session is None:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(path, _wants_html(request))
    return session


Session = Annotated[AdminSession, Depends(require_session)]


async def start_session(request: Request, response: Response) -> None:
    """Record a fresh session in the registry and set its cookie on `response` (after a login)."""
    payload = {"sid": secrets.token_urlsafe(32), "csrf": secrets.token_urlsafe(32)}
    core = app_state(request)
    await core.admin_calls.run(core.registry.admin_sessions.create, payload["sid"], SESSION_SECONDS)
    value = ui_state(request).signer.dumps(payload)
    response.set_cookie(SESSION_COOKIE, value, **_cookie_kwargs(request, SESSION_SECONDS))
    response.delete_cookie(LOGIN_CSRF_COOKIE, path=COOKIE_PATH)


async def end_session(request: Request, response: Response, session: AdminSession) -> None:
    """Revoke `session` in the registry (for every replica, for good) and clear its cookie."""
    core = app_state(request)
    await core.admin_calls.run(core.registry.admin_sessions.revoke, session.sid)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)


def _same(a: str | None, b: str) -> bool:
    return bool(a) and hmac.compare_digest(str(a).encode(), b.encode())


async def presented_csrf(request: Request) -> str | None:
    """The CSRF token the request carries: the `X-CSRF-Token` header, else the `csrf_token` form field."""
    header = request.headers.get(CSRF_HEADER)
    if header:
        return header
    ctype = request.headers.get("content-type", "")
    if ctype.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        value = (await request.form()).get(CSRF_FIELD)
        return value if isinstance(value, str) else None
    return None


async def require_csrf(request: Request, session: Session) -> AdminSession:
    """Dependency for POST routes: the session, if the request carries its CSRF token; else 403."""
    if not _same(await presented_csrf(request), session.csrf):
        raise CsrfRejected("missing or wrong CSRF token")
    return session


CsrfSession = Annotated[AdminSession, Depends(require_csrf)]


def login_csrf(request: Request) -> str:
    """The login form's CSRF token: the one in the pre-session cookie if valid, else a new one."""
    raw = request.cookies.get(LOGIN_CSRF_COOKIE)
    if raw:
        try:
            token = ui_state(request).signer.loads(raw, max_age=LOGIN_CSRF_SECONDS, salt="login-csrf")
            if isinstance(token, str):
                return token
        except (BadSignature, SignatureExpired):
            pass
    return secrets.token_urlsafe(32)


def set_login_csrf(request: Request, response: Response, token: str) -> None:
    value = ui_state(request).signer.dumps(token, salt="login-csrf")
    response.set_cookie(LOGIN_CSRF_COOKIE, value, **_cookie_kwargs(request, LOGIN_CSRF_SECONDS))


async def check_login_csrf(request: Request) -> None:
    """Double-submit check of the login form: form field == signed cookie's token, else 403."""
    raw = request.cookies.get(LOGIN_CSRF_COOKIE)
    expected = None
    if raw:
        try:
            expected = ui_state(request).signer.loads(raw, max_age=LOGIN_CSRF_SECONDS, salt="login-csrf")
        except (BadSignature, SignatureExpired):
            expected = None
    if not isinstance(expected, str) or not _same(await presented_csrf(request), expected):
        raise CsrfRejected("missing or wrong CSRF token; reload the login page and try again")


def login_url(next_path: str) -> str:
    return f"/admin/login?next={quote(safe_next(next_path), safe='/')}"
