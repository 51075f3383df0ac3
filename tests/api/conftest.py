"""Server-test helpers re-exported for `from tests.api.conftest import ...` (fixtures: tests/conftest.py)."""

from __future__ import annotations

from tests.helpers.served import SERVED_ADAPTERS, register

__all__ = ["SERVED_ADAPTERS", "register"]
