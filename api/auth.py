"""Admin-token and API-key checks (constant-time), as FastAPI dependencies.

The admin token comes from `LORAPLEX_ADMIN_TOKEN`; when it is unset, `ensure_admin_token` generates one
at first start, prints it once, and keeps only its sha256 in `<data dir>/admin_token.sha256`. The admin
API is never open.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from api.errors import APIError
from api.state import app_state
from lora_registry.errors import RegistryUnavailable

TOKEN_FILE = "admin_token.sha256"


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(slots=True)
class AdminAuth:
    token_sha256: str

    def check(self, presented: str | None) -> bool:
        """True when `presented` is the admin token (compared in constant time on the hashes)."""
        if not presented:
            return False
        return hmac.compare_digest(_sha256(presented), self.token_sha256)


def ensure_admin_token(
    data_dir: Path, configured: str | None, *, store: bool = True
) -> tuple[AdminAuth, str | None]:
    """The admin check, and the token in clear text if it was generated just now (to print once).

    With `store=False` a generated token is not written yet: `loraplex serve` stores it (and prints it)
    with `store_admin_token` only once the server is serving, so a start that fails leaves none behind."""
    if configured:
        return AdminAuth(_sha256(configured)), None
    path = data_dir / TOKEN_FILE
    if path.is_file():
        return AdminAuth(path.read_text().strip()), None
    token = secrets.token_urlsafe(32)
    if store:
        store_admin_token(data_dir, token)
    return AdminAuth(_sha256(token)), token


def store_admin_token(data_dir: Path, token: str) -> None:
    """Keep `token`'s sha256 as the admin token of `data_dir` (written atomically, mode 0600)."""
    path = data_dir / TOKEN_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_sha256(token))
    tmp.chmod(0o600)
    tmp.replace(path)


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


async def require_admin(request: Request) -> str:
    """Dependency: 401 without a bearer token, 403 with a wrong one, 429 while this client's guesses
    are throttled (`AuthThrottle`). Returns the actor name."""
    token = bearer(request)
    if token is None:
        raise APIError(401, "admin token required: send 'Authorization: Bearer <token>'")
    state = app_state(request)
    if getattr(request.state, "loraplex_admin_checked", False) and state.admin_auth.check(token):
        return "admin"  # verified (through the throttle) by the request guard already
    await check_admin_token(state, request.client.host if request.client else "?", token)
    return "admin"


async def check_admin_token(state, client: str, token: str) -> None:
    """Check `token` against the admin token through `client`'s guess throttle (`AuthThrottle`): 429
    while this client's guesses are throttled, 403 when the token is wrong."""
    ok = await state.auth_throttle.check(client, lambda: state.admin_auth.check(token))
    if ok is None:
        retry = str(state.auth_throttle.retry_after())
        raise APIError(
            429, "too many wrong admin tokens from this client; slow down", headers={"Retry-After": retry}
        )
    if not ok:
        raise APIError(403, "invalid admin token")


async def authenticate(request: Request):
    """The caller's API key (or "admin" for the admin token and the static `--api-key`, which may use
    every model); None when keys are not required.

    401 without a valid key when the server requires API keys.
    """
    state = app_state(request)
    if not state.settings.require_api_key:
        return None
    secret = bearer(request)
    if secret is None:
        raise APIError(401, "API key required: send 'Authorization: Bearer <key>'")
    if state.admin_auth.check(secret) or static_key_ok(state.settings, secret):
        return "admin"
    key = await verify_key(state, secret)
    if key is None:
        raise APIError(401, "invalid API key")
    return key


def static_key_ok(settings, secret: str) -> bool:
    """Whether `secret` is the server's static `--api-key` (constant time); False when none is set."""
    key = settings.api_key
    return bool(key) and hmac.compare_digest(_sha256(secret), _sha256(key))


async def verify_key(state, secret: str):
    """The API key `secret` is (None if invalid).

    Hot path: a key the in-memory `KeyCache` knows (every key, kept current by the registry's events and
    resync) is checked there, with no database call, so keyed requests keep working through a database
    outage. Only a prefix the cache has never seen is looked up in the database on the registry lookup
    lane (the key may have been created a moment ago elsewhere); 503 when the registry cannot be
    reached to check it, since the cache cannot tell a brand-new key from a wrong one."""
    known, key = state.key_cache.lookup(secret)
    if known:
        return key
    try:
        return await state.lookups.run(state.key_cache.fetch, secret)
    except RegistryUnavailable as exc:
        raise APIError(
            503,
            "the registry is unreachable, so this API key (unknown to this server) cannot be checked; "
            "retry shortly",
            code="registry_unavailable",
            headers={"Retry-After": "2"},
        ) from exc


def may_use(key, adapter: str | None) -> bool:
    """Whether `key` may use `adapter` (None = the base model).

    No key (keys not required), the admin token or an admin-scoped key may use everything; a key scoped to
    named adapters may use only those (not the base model).
    """
    if key is None or key == "admin" or key.is_admin:
        return True
    return adapter is not None and key.allows_adapter(adapter)


def authorize(key, adapter: str | None) -> None:
    """403 unless `key` may use `adapter` (None = the base model)."""
    if not may_use(key, adapter):
        target = f"adapter {adapter!r}" if adapter else "the base model"
        raise APIError(403, f"this API key is not allowed to use {target}")
