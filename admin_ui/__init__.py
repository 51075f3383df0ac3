"""Server-rendered admin pages under `/admin`: login, dashboard, adapters, playground, API keys.

`mount(app)` adds the routes, the static files and the login-redirect / CSRF error handlers to the API's
FastAPI app; nothing happens at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI


def mount(app: FastAPI) -> None:
    """Attach the admin UI to `app` (called by `api.app.create_app`)."""
    from admin_ui.app import mount_admin_ui

    mount_admin_ui(app)
