"""Registry change events and the bus they travel on.

Every change publishes a `RegistryEvent` after its transaction commits. `EventBus` is the interface;
`InProcessBus` (the default) calls subscribers synchronously in the publishing thread, `RedisEventBus`
(`redis_bus.py`) fans events out to every process subscribed to one Redis channel.

A subscriber may pass `on_resync`: it is called whenever the subscription (re)connects, because events
published while it was not connected are lost; the subscriber then re-reads the registry's state.

A change committed by this process is also handed to this process's subscribers at once, by
`deliver_local` (the outbox calls it right after the commit), whatever the bus does: a server applies
its own changes even while Redis is down. Each subscription remembers the ids delivered that way and
drops the same event when it comes back over the network, so it sees each event once.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

log = logging.getLogger(__name__)

ADAPTER_REGISTERED = "adapter.registered"
ADAPTER_ACTIVATED = "adapter.activated"
ADAPTER_DEACTIVATED = "adapter.deactivated"
ADAPTER_DELETED = "adapter.deleted"
ADAPTER_ROLLED_BACK = "adapter.rolled_back"
KEY_CREATED = "key.created"
KEY_REVOKED = "key.revoked"


@dataclass(slots=True, frozen=True)
class RegistryEvent:
    """One change. For adapter events `status`/`version`/`digest` describe the adapter after it."""

    type: str
    name: str
    status: str | None = None
    version: int | None = None
    digest: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RegistryEvent:
        raw: dict[str, Any] = json.loads(text)
        fields: dict[str, Any] = {
            k: raw.get(k) for k in ("type", "name", "status", "version", "digest", "id", "at")
        }
        return cls(**fields)


Handler = Callable[[RegistryEvent], None]


class Subscription(Protocol):
    def close(self) -> None: ...


class EventBus(Protocol):
    def publish(self, event: RegistryEvent) -> None: ...

    def subscribe(self, handler: Handler, on_resync: Callable[[], None] | None = None) -> Subscription:
        """Deliver every later event to `handler`; call `on_resync` on every (re)connect."""
        ...

    def deliver_local(self, event: RegistryEvent) -> None:
        """Hand `event` (a change this process just committed) to this process's subscribers now."""
        ...

    def close(self) -> None: ...


def call_safely(fn: Callable[..., None], *args: Any) -> bool:
    """Run a subscriber callback; a failing subscriber is logged and never breaks the publisher.
    Returns whether it succeeded."""
    try:
        fn(*args)
    except Exception:
        log.exception("event subscriber %r failed", fn)
        return False
    return True


class RecentIds:
    """The ids of the last `size` events delivered locally (thread-safe): `seen(id)` is True once for
    each id `add`ed, so the bus's own copy of a locally delivered event is dropped exactly once."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, event_id: str) -> None:
        with self._lock:
            self._ids[event_id] = None
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)

    def seen(self, event_id: str) -> bool:
        """Whether `event_id` was delivered locally (and forget it: a later copy is delivered again)."""
        with self._lock:
            return self._ids.pop(event_id, 0) is None


def deliver_local_to(subs: list[Any], event: RegistryEvent) -> None:
    """Call every subscription's handler with `event`, and have each one that succeeded drop the bus's
    later copy (`sub.recent`); a failed one gets a second chance from that copy."""
    for sub in subs:
        if call_safely(sub.handler, event):
            sub.recent.add(event.id)


@dataclass(slots=True)
class _LocalSubscription:
    bus: InProcessBus
    handler: Handler
    recent: RecentIds = field(default_factory=lambda: RecentIds(256))

    def close(self) -> None:
        self.bus._remove(self)


class InProcessBus:
    """Delivers events to subscribers in this process, synchronously, in publish order."""

    def __init__(self) -> None:
        self._subs: list[_LocalSubscription] = []
        self._lock = threading.Lock()

    def publish(self, event: RegistryEvent) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            if not sub.recent.seen(event.id):  # else delivered already, right after its commit
                call_safely(sub.handler, event)

    def deliver_local(self, event: RegistryEvent) -> None:
        with self._lock:
            subs = list(self._subs)
        deliver_local_to(subs, event)

    def subscribe(self, handler: Handler, on_resync: Callable[[], None] | None = None) -> Subscription:
        sub = _LocalSubscription(self, handler)
        with self._lock:
            self._subs.append(sub)
        if on_resync is not None:
            call_safely(on_resync)
        return sub

    def _remove(self, sub: _LocalSubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        with self._lock:
            self._subs.clear()
