"""Admin UI login sessions, kept in the registry database so that a logout holds everywhere: after a
restart and on every replica sharing the registry. The session id lives in the (signed) cookie; only
its sha256 is stored, with when it expires and whether it was revoked."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.dbsession import transaction
from lora_registry.models import AdminSessionRow


def _key(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


class AdminSessionStore:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def create(self, sid: str, lifetime_seconds: float) -> None:
        """Record a new login `sid`, valid for `lifetime_seconds`; expired sessions are forgotten."""
        now = datetime.now(UTC)
        with transaction(self.sessions) as s:
            s.execute(delete(AdminSessionRow).where(AdminSessionRow.expires_at < now))
            s.add(AdminSessionRow(sid_hash=_key(sid), expires_at=now + timedelta(seconds=lifetime_seconds)))

    def is_valid(self, sid: str) -> bool:
        """True while `sid` was created here, has not expired and was not revoked."""
        with transaction(self.sessions) as s:
            row = s.get(AdminSessionRow, _key(sid))
            return row is not None and row.revoked_at is None and row.expires_at > datetime.now(UTC)

    def revoke(self, sid: str) -> None:
        """End `sid` (logout); revoking an unknown or ended session is a no-op."""
        with transaction(self.sessions) as s:
            row = s.get(AdminSessionRow, _key(sid))
            if row is not None and row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
