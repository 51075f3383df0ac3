"""The transactional outbox: registry events are written with their change and published afterwards.

A change and its event row commit together (`Outbox.add` inside the change's transaction), so an
event can never be lost for a committed change, nor sent for a change that rolled back. Publishing is
a second step, `Outbox.flush()`: right after the commit (the usual case: delivered at once), and again
from `OutboxRelay`, a background thread in every server, while rows are pending. So when the event
bus (Redis) is down, the change still succeeds (its caller is told the truth: committed), its event
waits in the table, and the first relay to run once Redis is back delivers it: replicas converge.

Delivery is at least once and in row order per process; subscribers treat events as triggers to
re-read the registry, so a duplicate is harmless. On PostgreSQL, relays of different replicas skip
each other's rows (`FOR UPDATE SKIP LOCKED`).

The process that made a change does not wait for the bus to hear of it: once the change commits, its
events go straight to this process's own subscribers (`EventBus.deliver_local`), so a server applies
its own committed changes at once, even while Redis is down (the bus's later copy is dropped).
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from lora_registry.dbsession import after_commit, transaction
from lora_registry.errors import RegistryError
from lora_registry.events import EventBus, RegistryEvent
from lora_registry.models import OutboxEvent

log = logging.getLogger(__name__)

KEEP_DELIVERED = 1000  # delivered rows kept (newest) for inspection; older ones are deleted


class Outbox:
    def __init__(self, sessions: sessionmaker[Session], bus: EventBus) -> None:
        self.sessions = sessions
        self.bus = bus
        self._lock = threading.Lock()  # one flush at a time in this process: events leave in order
        self._failing = False

    def add(self, session: Session, event: RegistryEvent) -> None:
        """Queue `event` in `session`'s transaction (committed, or rolled back, with the change); once
        it commits, this process's subscribers get it at once."""
        session.add(OutboxEvent(payload=event.to_json()))
        after_commit(session, lambda: self.bus.deliver_local(event))

    def flush(self, limit: int = 200) -> int:
        """Publish pending events oldest first; return how many are still pending afterwards.

        Stops at the first event the bus refuses (it stays pending, with those after it). Never raises
        for a bus or database failure: the relay tries again later."""
        with self._lock:
            try:
                left, failure = self._flush(limit)
            except RegistryError as exc:
                left, failure = -1, f"registry database unreachable ({exc})"
            if failure is not None and not self._failing:  # logged once per outage, not per retry
                log.warning("event outbox: %s; events stay pending and are retried", failure)
            self._failing = failure is not None
            return left

    def _flush(self, limit: int) -> tuple[int, str | None]:
        """(events still pending, why the bus refused one or None)."""
        with transaction(self.sessions) as s:
            q = (
                select(OutboxEvent)
                .where(OutboxEvent.delivered_at.is_(None))
                .order_by(OutboxEvent.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            rows = list(s.scalars(q))
            delivered = 0
            for row in rows:
                try:
                    self.bus.publish(RegistryEvent.from_json(row.payload))
                except RegistryError as exc:
                    return len(rows) - delivered, str(exc)  # those delivered so far are committed
                row.delivered_at = datetime.now(UTC)
                delivered += 1
            if delivered:
                self._prune(s, rows[delivered - 1].id)
        return (0 if len(rows) < limit else self.pending()), None

    @staticmethod
    def _prune(s: Session, newest: int) -> None:
        s.execute(
            delete(OutboxEvent).where(
                OutboxEvent.delivered_at.is_not(None), OutboxEvent.id <= newest - KEEP_DELIVERED
            )
        )

    def pending(self) -> int:
        """How many events wait to be published."""
        with transaction(self.sessions) as s:
            q = select(func.count()).select_from(OutboxEvent).where(OutboxEvent.delivered_at.is_(None))
            return int(s.scalar(q) or 0)


class OutboxRelay:
    """A daemon thread that flushes the outbox every `interval` seconds (and on `wake()`)."""

    def __init__(self, outbox: Outbox, interval: float = 1.0) -> None:
        self.outbox = outbox
        self.interval = interval
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraplex-outbox-relay", daemon=True)

    def start(self) -> OutboxRelay:
        self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.outbox.flush()
            self._wake.wait(self.interval)
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
