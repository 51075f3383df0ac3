"""Adapter and key names: `^[a-z0-9][a-z0-9._-]{0,63}$` (one rule for the registry, API and CLI)."""

from __future__ import annotations

import re

from lora_registry.errors import InvalidName

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def validate_name(name: str, what: str = "adapter name") -> str:
    """Return `name` if it is a valid name, else raise `InvalidName`."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise InvalidName(
            f"{what} {name!r} is invalid: use 1-64 characters a-z, 0-9, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name
