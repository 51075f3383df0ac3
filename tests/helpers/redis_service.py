"""The local Redis for tests that need one (fails under CI when unreachable, else skips)."""

from __future__ import annotations

import os
import secrets

import pytest
import redis

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def require_redis() -> str:
    """The test Redis URL once it answers PING."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        msg = f"Redis at {REDIS_URL} is unreachable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    finally:
        client.close()
    return REDIS_URL


def unique_prefix() -> str:
    """A key prefix no other test (or earlier run) uses."""
    return f"loraplex-test:{secrets.token_hex(4)}:"
