"""A throw-away PostgreSQL database on the local server, for one test session."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from sqlalchemy.engine import make_url

ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"


@contextmanager
def postgres_database() -> Iterator[str]:
    """Create `loraplex_test_<random>` and yield its SQLAlchemy URL; drop it afterwards.

    Unreachable server: the test fails when `CI` is set (CI must test PostgreSQL), else it is skipped.
    """
    admin = os.environ.get("LORAPLEX_TEST_POSTGRES_URL", ADMIN_URL)
    try:
        conn = psycopg.connect(admin, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        msg = f"PostgreSQL at {admin} is unreachable: {str(exc).strip().splitlines()[0]}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    name = f"loraplex_test_{secrets.token_hex(5)}"
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin).set(drivername="postgresql+psycopg", database=name).render_as_string(False)
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()
