"""Keep a serving process in step with the registry through the event bus.

`RegistryFollower` holds the set of active adapters (name → digest) and calls `on_change(name, adapter)`
with the new `ActiveAdapter` (or None when the name stops being served) whenever it changes. Events are
only a trigger: the follower re-reads the registry for the named adapter, and re-reads everything on
every (re)connect of the bus, so reordered, duplicated or missed events cannot leave it stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from lora_registry.events import EventBus, RegistryEvent, Subscription
from lora_registry.schemas import ActiveAdapter
from lora_registry.service import RegistryService

ChangeHandler = Callable[[str, ActiveAdapter | None], None]


class RegistryFollower:
    def __init__(self, service: RegistryService, bus: EventBus, on_change: ChangeHandler) -> None:
        self.service = service
        self.bus = bus
        self.on_change = on_change
        self.resyncs = 0
        self.changed_at: dict[str, float] = {}  # name -> wall-clock time this follower last changed it
        self._active: dict[str, ActiveAdapter] = {}
        self._lock = threading.RLock()
        self._sub: Subscription | None = None

    def start(self) -> RegistryFollower:
        self._sub = self.bus.subscribe(self._on_event, on_resync=self.resync)
        return self

    def snapshot(self) -> dict[str, ActiveAdapter]:
        """The active adapters as this follower currently believes them to be."""
        with self._lock:
            return dict(self._active)

    def get(self, name: str) -> ActiveAdapter | None:
        """The active adapter `name` as this follower believes it to be (memory only, no database)."""
        with self._lock:
            return self._active.get(name)

    def resync(self) -> None:
        """Re-read every active adapter and report the differences."""
        fresh = {a.name: a for a in self.service.active_adapters()}
        with self._lock:
            self.resyncs += 1
            for name in sorted(set(self._active) | set(fresh)):
                self._set(name, fresh.get(name))

    def _on_event(self, event: RegistryEvent) -> None:
        if not event.type.startswith("adapter."):
            return
        current = self.service.active_adapter(event.name)
        with self._lock:
            self._set(event.name, current)

    def _set(self, name: str, adapter: ActiveAdapter | None) -> None:
        if self._active.get(name) == adapter:
            return
        if adapter is None:
            self._active.pop(name, None)
        else:
            self._active[name] = adapter
        self.changed_at[name] = time.time()
        self.on_change(name, adapter)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close()
            self._sub = None
