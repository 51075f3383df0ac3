"""Typed registry errors: each carries a message fit to show a user as one line."""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every error the registry reports to a user."""

    status_code = 400


class InvalidAdapter(RegistryError):
    """The uploaded adapter (or zip) was refused; nothing was stored."""

    status_code = 422


class InvalidName(RegistryError):
    """A name does not match the allowed pattern."""

    status_code = 422


class NotFound(RegistryError):
    """No adapter, version or key by that name."""

    status_code = 404


class Conflict(RegistryError):
    """The change conflicts with the current state (e.g. a concurrent registration)."""

    status_code = 409


class RegistryUnavailable(RegistryError):
    """The database is unreachable or its schema is not initialised."""

    status_code = 503


class BlobCorrupt(RegistryError):
    """A stored blob no longer matches its digest."""

    status_code = 500


def first_line(exc: BaseException) -> str:
    """The first line of a (database driver) error's message, for one-line reports."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__
