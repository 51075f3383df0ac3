"""`EngineReplica`: one engine behind a Ray Serve replica, following the shared registry itself.

It reuses the single-server parts: an `EngineClient` (engine process + ZeroMQ) and a `RegistryFollower`.
Requests arrive as encoded `AddRequest`s and leave as a stream of `StreamItem`s. An adapter request is
served only if this replica's own view of the registry has the adapter's digest active (re-checked in
the database before refusing, so a fresh activation is never refused), and its weights come from this
replica's blob store, never from a path the ingress saw: replicas may live on other machines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from api.engine_client import EngineClient
from api.engine_protocol import AddRequest, decode_to_engine, encode
from api.settings import ServerSettings
from engine.lora_request import LoRARequest
from lora_registry import open_registry
from lora_registry.follower import RegistryFollower
from lora_registry.registry import Registry
from lora_registry.schemas import ActiveAdapter

log = logging.getLogger("loraplex.replica")


class StreamItem(msgspec.Struct, array_like=True):
    """One item of a replica's answer: the replica's id, then engine deltas (encoded), or a refusal."""

    replica: str
    delta: bytes | None = None
    refused: str | None = None  # why the adapter cannot be served here (the ingress answers 404)


@dataclasses.dataclass(slots=True)
class LoadedAdapter:
    """What the replica's multiplexed LRU holds: an adapter made resident in this replica's engine."""

    name: str
    digest: str
    path: str


class AdapterRefused(LookupError):
    pass


class EngineReplica:
    def __init__(self, settings: ServerSettings, replica_id: str) -> None:
        self.settings = settings
        self.replica_id = replica_id
        self.client = EngineClient(settings.engine)
        self.registry: Registry | None = None
        self.follower: RegistryFollower | None = None
        self.multiplexed_loads = 0  # adapters loaded by Ray's multiplexed loader (its LRU misses)
        self._unhealthy_since: float | None = None

    async def start(self) -> None:
        """Open the registry, start the engine, follow the registry (events + a short resync)."""
        reg_settings = self.settings.registry
        assert reg_settings is not None
        self.registry = await asyncio.to_thread(open_registry, reg_settings, auto_upgrade=False)
        await self.client.start()
        loop = asyncio.get_running_loop()

        def on_change(name: str, adapter: ActiveAdapter | None) -> None:
            if adapter is None:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drop(name)))

        self.follower = follower = RegistryFollower(self.registry.adapters, self.registry.bus, on_change)
        await asyncio.to_thread(follower.start)
        if follower.resyncs == 0:
            await asyncio.to_thread(follower.resync)
        self._resync = asyncio.create_task(self._resync_forever(follower))

    async def _resync_forever(self, follower: RegistryFollower) -> None:
        """Resync `follower` with the registry every `registry_resync_seconds`, until cancelled."""
        while True:
            await asyncio.sleep(self.settings.registry_resync_seconds)
            try:
                await asyncio.to_thread(follower.resync)
            except Exception as exc:
                log.warning("registry resync failed: %s", exc)

    async def _drop(self, name: str) -> None:
        try:
            keep = {a.digest for a in self.follower.snapshot().values()} if self.follower else set()
            await self.client.adapter_call("remove", name, keep=keep)
        except Exception as exc:  # in use or engine restarting: the pool's LRU evicts it later
            log.info("could not drop adapter %r now: %s", name, exc)

    async def stop(self) -> None:
        self._resync.cancel()
        if self.follower is not None:
            self.follower.close()
        await self.client.shutdown()
        if self.registry is not None:
            self.registry.close()

    # ---- adapters --------------------------------------------------------------------------------
    async def active(self, digest: str, name: str | None) -> ActiveAdapter | None:
        """The active adapter with content `digest`, from the follower, else re-read from the database."""
        assert self.follower is not None and self.registry is not None
        for a in self.follower.snapshot().values():
            if a.digest == digest:
                return a
        if name:
            fresh = await asyncio.to_thread(self.registry.adapters.active_adapter, name)
            if fresh is not None and fresh.digest == digest:
                return fresh
        return None

    async def load(self, digest: str, name: str | None = None) -> LoadedAdapter:
        """Make the adapter `digest` resident in this engine (the multiplexed loader's work)."""
        active = await self.active(digest, name)
        if active is None:
            raise AdapterRefused(f"the adapter {name or digest!r} is not active")
        assert self.registry is not None
        path = await asyncio.to_thread(self.registry.adapters.adapter_path, digest)
        await self.client.adapter_call("add", active.name, str(path), digest)
        return LoadedAdapter(active.name, digest, str(path))

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, payload: bytes, adapter: LoadedAdapter | None) -> AsyncIterator[bytes]:
        """Run one engine request; yields encoded `StreamItem`s, the replica's id first."""
        req = decode_to_engine(payload)
        assert isinstance(req, AddRequest)
        yield _item(self.replica_id)
        if req.lora is not None and req.lora.digest is not None:
            try:
                if adapter is None or adapter.digest != req.lora.digest:
                    adapter = await self.load(req.lora.digest, req.lora.name)
                elif await self.active(adapter.digest, adapter.name) is None:
                    raise AdapterRefused(f"the adapter {adapter.name!r} is not active")
            except AdapterRefused as exc:
                yield _item(self.replica_id, refused=str(exc))
                return
            req = msgspec.structs.replace(req, lora=LoRARequest(adapter.name, adapter.path, adapter.digest))
        async for delta in self.client.generate(req):
            yield _item(self.replica_id, delta=encode(delta))

    def check_health(self, grace_seconds: float = 120.0) -> None:
        """Raise when the engine has been down longer than `grace_seconds` (its client restarts a dead
        engine by itself; Serve replaces a replica whose check keeps failing)."""
        if self.client.healthy:
            self._unhealthy_since = None
            return
        now = time.monotonic()
        self._unhealthy_since = self._unhealthy_since or now
        if now - self._unhealthy_since > grace_seconds:
            raise RuntimeError(f"engine down for more than {grace_seconds:.0f} s")

    def describe(self) -> dict[str, Any]:
        """This replica's state: engine info and stats, active adapters as it sees them (and when each name
        last changed, wall clock), multiplexed loads."""
        c = self.client
        stats = c.stats
        return {
            "replica": self.replica_id,
            "healthy": c.healthy,
            "restarts": c.restarts,
            "in_flight": c.num_in_flight(),
            "info": encode(c.info) if c.info is not None else None,
            "stats": encode(stats) if stats is not None else None,
            "active": {n: a.digest for n, a in (self.follower.snapshot() if self.follower else {}).items()},
            "changed_at": dict(self.follower.changed_at) if self.follower else {},
            "multiplexed_loads": self.multiplexed_loads,
        }


_encoder = msgspec.msgpack.Encoder()


def _item(replica: str, delta: bytes | None = None, refused: str | None = None) -> bytes:
    return _encoder.encode(StreamItem(replica, delta, refused))


decode_item = msgspec.msgpack.Decoder(StreamItem).decode
