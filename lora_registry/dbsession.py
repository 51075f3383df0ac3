"""A transaction scope that turns database failures into one-line registry errors, and runs the
callbacks a change registered with `after_commit` once (and only if) it committed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.errors import Conflict, RegistryError, RegistryUnavailable, first_line

AFTER_COMMIT = "loraplex_after_commit"  # session.info key: callbacks to run once the commit succeeded


def after_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run `callback()` once `session`'s `transaction()` has committed (never if it rolls back)."""
    session.info.setdefault(AFTER_COMMIT, []).append(callback)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """`with transaction(f) as s:` commits on success, rolls back on error, and maps DB errors:
    a missing schema, an unreachable or stalled server (connect/statement/pool timeouts) →
    `RegistryUnavailable`, a constraint violation → `Conflict`, a value the column refuses → `RegistryError`.
    """
    try:
        with factory.begin() as session:
            yield session
            callbacks = session.info.pop(AFTER_COMMIT, [])
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
    for callback in callbacks:
        callback()
