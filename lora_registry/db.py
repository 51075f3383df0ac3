"""Database engines and sessions for a registry URL (SQLite or PostgreSQL), with bounded waits.

Every wait on the database has a limit, so a stalled or unreachable server turns into an error instead
of a thread blocked forever:
- PostgreSQL: `connect_timeout` (libpq counts whole seconds, at least 2), the wait for a pooled
  connection (`pool_timeout`), a server-side `statement_timeout`, and TCP keepalives plus
  `tcp_user_timeout` so a silently dead link is noticed.
- SQLite: the busy timeout (how long a statement waits for another writer's lock).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def make_engine(
    url: str, connect_timeout: float | None = 5.0, statement_timeout: float | None = 15.0
) -> Engine:
    """An engine for `url`; SQLite gets its parent dir created, foreign keys on, WAL and a busy timeout.

    `statement_timeout=None` lifts the per-statement limit (migrations may run long)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        busy = statement_timeout if statement_timeout is not None else 30.0
        engine = create_engine(url, connect_args={"timeout": busy})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() != "postgresql" or connect_timeout is None:
        return create_engine(url, pool_pre_ping=True)
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_timeout=connect_timeout,
        connect_args=postgres_connect_args(parsed.query, connect_timeout, statement_timeout),
    )


def postgres_connect_args(
    query: Any, connect_timeout: float, statement_timeout: float | None
) -> dict[str, Any]:
    """libpq connection parameters bounding every wait; options already in the URL are kept."""
    args: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(connect_timeout)),
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": int(1000 * max(connect_timeout, statement_timeout or 0) + 5000),
    }
    if statement_timeout is not None:
        options = str(query.get("options", "")).strip()
        args["options"] = f"{options} -c statement_timeout={int(statement_timeout * 1000)}".strip()
    return args


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
