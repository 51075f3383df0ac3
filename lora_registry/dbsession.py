"""A transaction scope that turns database failures into one-line registry errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.errors import Conflict, RegistryError, RegistryUnavailable, first_line


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """`with transaction(f) as s:` commits on success, rolls back on error, and maps DB errors:
    a missing schema, an unreachable or stalled server (connect/statement/pool timeouts) →
    `RegistryUnavailable`, a constraint violation → `Conflict`, a value the column refuses → `RegistryError`.
    """
    try:
        with factory.begin() as session:
            yield session
    except sa_exc.IntegrityError as exc:
        raise Conflict(f"conflicting concurrent change ({type(exc.orig or exc).__name__}); retry") from exc
    except sa_exc.DataError as exc:
        raise RegistryError(f"value refused by the registry database: {first_line(exc)}") from exc
    except sa_exc.TimeoutError as exc:  # no pooled connection came free in time
        raise RegistryUnavailable(f"registry database unavailable: {first_line(exc)}") from exc
    except sa_exc.DBAPIError as exc:
        first = first_line(exc)
        text = first.lower()
        if "no such table" in text or ("relation" in text and "does not exist" in text):
            raise RegistryUnavailable(
                "the registry database has no schema yet: run `loraplex db upgrade`"
            ) from exc
        raise RegistryUnavailable(f"registry database unavailable: {first}") from exc
