"""Per-app state of the admin UI (session signer, rate meter), created on first use. Sessions themselves
are kept in the registry database (`lora_registry.admin_sessions`).

The session-signing secret is HMAC(random per-data-dir secret, admin token hash): a stolen data dir file
alone does not forge sessions for a different token, and changing the admin token logs everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from itsdangerous import URLSafeTimedSerializer

from admin_ui.rates import RateMeter
from api.state import app_state

SECRET_FILE = "admin_ui_secret"
SESSION_SALT = "loraplex-admin-session"
_create_lock = threading.Lock()


@dataclass(slots=True)
class UiState:
    signer: URLSafeTimedSerializer
    rates: RateMeter = field(default_factory=RateMeter)


def read_or_create_secret(data_dir: Path) -> bytes:
    """The random secret in `<data_dir>/admin_ui_secret`, written (mode 0600, atomically) if absent."""
    path = data_dir / SECRET_FILE
    if path.is_file():
        return bytes.fromhex(path.read_text().strip())
    data_dir.mkdir(parents=True, exist_ok=True)
    value = secrets.token_bytes(32)
    tmp = path.with_name(f".{SECRET_FILE}.{secrets.token_hex(4)}")
    tmp.write_text(value.hex())
    tmp.chmod(0o600)
    tmp.replace(path)
    return bytes.fromhex(path.read_text().strip())


def ui_state(request: Request) -> UiState:
    """The admin UI's state for this app, created on the first request (after the server's lifespan)."""
    app_attrs = request.app.state
    existing = getattr(app_attrs, "admin_ui", None)
    if existing is not None:
        return existing
    with _create_lock:
        existing = getattr(app_attrs, "admin_ui", None)
        if existing is None:
            core = app_state(request)
            file_secret = read_or_create_secret(core.registry.settings.data_dir)
            token_hash = core.admin_auth.token_sha256.encode()
            key = hmac.new(file_secret, token_hash, hashlib.sha256).hexdigest()
            existing = UiState(URLSafeTimedSerializer(key, salt=SESSION_SALT))
            app_attrs.admin_ui = existing
    return existing


UiStateDep = Annotated[UiState, Depends(ui_state)]
