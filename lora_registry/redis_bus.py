"""Redis pub/sub event bus: every replica sharing one registry follows the same changes.

Each subscription runs a daemon thread that listens on the channel. When the connection drops it
retries with backoff and, once subscribed again, calls `on_resync` so the subscriber re-reads the
registry and catches up on whatever was published while it was away (pub/sub does not buffer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lora_registry.errors import RegistryUnavailable
from lora_registry.events import Handler, RecentIds, RegistryEvent, call_safely, deliver_local_to

log = logging.getLogger(__name__)


class RedisEventBus:
    def __init__(
        self,
        url: str,
        channel: str = "loraplex:events",
        retry_delay: float = 0.5,
        client_name: str | None = None,
    ) -> None:
        self.url = url
        self.channel = channel
        self.retry_delay = retry_delay
        self.client_name = client_name
        # Publishing gives up fast (the outbox keeps the event and the relay retries).
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=2, socket_timeout=2, retry=Retry(NoBackoff(), 1)
        )
        self._subs: list[RedisSubscription] = []

    def publish(self, event: RegistryEvent) -> None:
        """Publish `event`; raises `RegistryUnavailable` if Redis is unreachable."""
        try:
            self._client.publish(self.channel, event.to_json())
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"event bus: cannot publish to Redis at {self.url} ({exc})") from exc

    def deliver_local(self, event: RegistryEvent) -> None:
        """Hand `event` to this process's subscribers now, Redis or not (a change committed here)."""
        deliver_local_to(list(self._subs), event)

    def subscribe(self, handler: Handler, on_resync: Callable[[], None] | None = None) -> RedisSubscription:
        sub = RedisSubscription(self, handler, on_resync)
        self._subs.append(sub)
        sub.start()
        return sub

    def close(self) -> None:
        for sub in self._subs:
            sub.close()
        self._subs.clear()
        self._client.close()


class RedisSubscription:
    """A listener thread on the bus's channel; `connected` is set while it is subscribed."""

    def __init__(self, bus: RedisEventBus, handler: Handler, on_resync: Callable[[], None] | None) -> None:
        self.bus = bus
        self.handler = handler
        self.on_resync = on_resync
        self.connected = threading.Event()
        self.recent = RecentIds()  # events delivered locally, whose Redis copy is dropped
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraplex-redis-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_connected(self, timeout: float = 10.0) -> bool:
        return self.connected.wait(timeout)

    def _run(self) -> None:
        delay = self.bus.retry_delay
        while not self._stop.is_set():
            # No silent retries inside redis-py: a dropped connection must surface here so that the
            # subscriber resyncs after reconnecting.
            client = redis.Redis.from_url(
                self.bus.url,
                socket_connect_timeout=5,
                health_check_interval=10,
                client_name=self.bus.client_name,
                retry=Retry(NoBackoff(), 0),
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.bus.channel)
                pubsub.get_message(timeout=1.0)  # wait for the subscribe confirmation
                self.connected.set()
                if self.on_resync is not None:
                    call_safely(self.on_resync)
                delay = self.bus.retry_delay
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None and msg.get("type") == "message":
                        self._deliver(msg["data"])
            except (redis.RedisError, OSError) as exc:
                log.warning("event bus: lost Redis connection (%s); retrying in %.1fs", exc, delay)
            finally:
                self.connected.clear()
                pubsub.close()
                client.close()
            if not self._stop.is_set():
                self.reconnects += 1
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)

    def _deliver(self, data: bytes) -> None:
        try:
            event = RegistryEvent.from_json(data)
        except (ValueError, TypeError):
            log.warning("event bus: ignoring malformed message %r", data[:200])
            return
        if self.recent.seen(event.id):
            return  # this process committed it and delivered it already
        call_safely(self.handler, event)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
