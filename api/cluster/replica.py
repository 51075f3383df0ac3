"""`EngineReplica`: one engine behind a Ray Serve replica, following the shared registry itself.

It reuses the single-server parts: an `EngineClient` (engine process + ZeroMQ) and a `RegistryFollower`.
Requests arrive as encoded `AddRequest`s and leave as a stream of `StreamItem`s. An adapter request is
served only if this replica's own view of the registry has the adapter's digest active (re-checked in
the database before refusing, so a fresh activation is never refused), and its weights come from this
replica's blob store, never from a path the ingress saw: replicas may live on other machines.

With the database blob store each replica keeps its own cache directory (`replica_data_dir`): it never
reads the driver's, the ingress's or another replica's files, so the database is the only way adapter
weights reach it. A replica whose engine process is down reports unhealthy at once (`check_health`), so
that Serve stops routing to it and replaces it; requests that reach it meanwhile are answered with a
`failed` item before any token, which the ingress retries on another replica.

For the affinity router it reports (`routing_stats`) its adapters by tier, its KV budget, and a summary of
the blocks its engine's prefix cache holds (`prefix_report`: the engine's own stored/evicted events, so
evicted blocks leave it); and it keeps the hot adapters the router spread onto it pinned (`hot_pins`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from api.cluster.hot_pins import HotPins
from api.cluster.prefix_report import HeldBlocks
from api.engine_client import EngineClient, EngineDeadError, EngineUnavailableError
from api.engine_protocol import AddRequest, KVEventsMsg, decode_to_engine, encode
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
    failed: str | None = None  # the engine failed the request, or is down (the ingress may retry)


@dataclasses.dataclass(slots=True)
class LoadedAdapter:
    """What the replica's multiplexed LRU holds: an adapter made resident in this replica's engine."""

    name: str
    digest: str
    path: str


class AdapterRefused(LookupError):
    pass


REPLICA_DIR_ENV = "LORAPLEX_REPLICA_DATA_DIR"  # where replicas make their own cache dirs (default: tmp)


def replica_data_dir(settings: ServerSettings, replica_id: str) -> Path | None:
    """A new cache directory of this replica's own (under `$LORAPLEX_REPLICA_DATA_DIR`, else the system's
    temporary directory), when the registry keeps blobs in the database; None with the local blob store,
    whose files are the blobs themselves and must be shared (one machine, or a shared volume)."""
    assert settings.registry is not None
    if settings.registry.blob_store != "database":
        return None
    base = Path(os.environ.get(REPLICA_DIR_ENV) or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"loraplex-{replica_id}-", dir=base))


class EngineReplica:
    def __init__(self, settings: ServerSettings, replica_id: str, pool_capacity: int = 1) -> None:
        self.settings = settings
        self.replica_id = replica_id
        self.pool_capacity = pool_capacity  # adapters of the largest rank its device pool holds
        self.client = EngineClient(dataclasses.replace(settings.engine, kv_events=True))
        self.client.on_kv_events = self._on_kv_events
        self.held: HeldBlocks | None = None  # the engine's prefix-cache blocks (from its first events)
        self._reports = 0  # routing-stats reports made so far: their sequence number
        self.hot = HotPins(replica_id, self._pin, max_pinned=pool_capacity - 1)
        self._pins: asyncio.Task | None = None
        self._restarts_seen = 0
        self.registry: Registry | None = None
        self.follower: RegistryFollower | None = None
        self.multiplexed_loads = 0  # adapters loaded by Ray's multiplexed loader (its LRU misses)
        self.data_dir: Path | None = None  # this replica's own cache dir (database blob store)
        self.loaded_paths: dict[str, str] = {}  # digest -> its directory in this replica's blob cache
        self.startup_seconds: dict[str, float] = {}
        self.node_id: str | None = None  # the Ray node this replica runs on (set by the deployment)
        self.placement: dict[str, Any] | None = None  # its placement group (tensor parallel), if any
        self._engine_up_once = False
        self._resync: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the registry (on this replica's own cache dir), start the engine, follow the registry
        (events + a short resync); logs how long each phase took."""
        reg_settings = self.settings.registry
        assert reg_settings is not None
        t0 = time.monotonic()
        self.data_dir = replica_data_dir(self.settings, self.replica_id)
        if self.data_dir is not None:
            reg_settings = dataclasses.replace(reg_settings, data_dir=self.data_dir)
        self.registry = await asyncio.to_thread(open_registry, reg_settings, auto_upgrade=False)
        t1 = time.monotonic()
        await self.client.start()
        self._engine_up_once = True
        t2 = time.monotonic()
        loop = asyncio.get_running_loop()

        def on_change(name: str, adapter: ActiveAdapter | None) -> None:
            if adapter is None:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drop(name)))

        self.follower = RegistryFollower(self.registry.adapters, self.registry.bus, on_change)
        await asyncio.to_thread(self.follower.start)
        if self.follower.resyncs == 0:
            await asyncio.to_thread(self.follower.resync)
        self._resync = asyncio.create_task(self._resync_forever())
        t3 = time.monotonic()
        self.startup_seconds = {"registry": t1 - t0, "engine": t2 - t1, "follower": t3 - t2, "total": t3 - t0}
        log.info(
            "replica %s ready in %.1f s: registry %.1f s, engine %.1f s, registry follower %.1f s "
            "(cache dir %s)",
            self.replica_id, t3 - t0, t1 - t0, t2 - t1, t3 - t2, self.data_dir or reg_settings.data_dir,
        )  # fmt: skip

    async def _resync_forever(self) -> None:
        """Resync the registry follower every `registry_resync_seconds`, until cancelled."""
        follower = self.follower
        assert follower is not None
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
        for task in (self._resync, self._pins):
            if task is not None:
                task.cancel()
        if self.follower is not None:
            self.follower.close()
        await self.client.shutdown()
        if self.registry is not None:
            self.registry.close()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

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

    async def resolve(self, digest: str, name: str | None = None) -> LoadedAdapter:
        """The active adapter `digest` as this replica's engine reads it: its name and its directory in
        this replica's blob cache (materialized from the database once, then remembered, digest -> path).
        Tells the engine nothing: a request carrying `LoRARequest(name, path, digest)` makes the engine
        load it in the background while its running batch goes on. `AdapterRefused` if not active."""
        active = await self.active(digest, name)
        if active is None:
            raise AdapterRefused(f"the adapter {name or digest!r} is not active")
        path = self.loaded_paths.get(digest)
        if path is None or not os.path.isdir(path):
            assert self.registry is not None
            path = str(await asyncio.to_thread(self.registry.adapters.adapter_path, digest))
            self.loaded_paths[digest] = path
        return LoadedAdapter(active.name, digest, path)

    async def load(self, digest: str, name: str | None = None) -> LoadedAdapter:
        """Make the adapter `digest` resident in this engine now (validated and in host memory when this
        returns; the engine loop does it, so its batch waits): for callers that need it there before
        their request (the disaggregated decode replica's KV import). Requests need no such call."""
        adapter = await self.resolve(digest, name)
        await self.client.adapter_call("add", adapter.name, adapter.path, digest)
        return adapter

    async def prefetch(self, digest: str, name: str | None = None) -> LoadedAdapter:
        """The multiplexed loader's work: resolve the adapter `digest` and have the engine start reading it
        into host memory in the background (never stalling its loop on the weights); its requests then
        find it loaded or loading."""
        adapter = await self.resolve(digest, name)
        await self.client.adapter_call("prefetch", adapter.name, adapter.path, digest)
        return adapter

    async def _local(self, lr: LoRARequest) -> LoRARequest:
        """A mix member as this replica's engine reads it (its files here; the engine loads it)."""
        if lr.digest is None:
            raise AdapterRefused(f"the adapter {lr.name!r} has no content digest")
        adapter = await self.resolve(lr.digest, lr.name)
        return LoRARequest(adapter.name, adapter.path, adapter.digest)

    # ---- what the router knows -------------------------------------------------------------------
    def _on_kv_events(self, msg: KVEventsMsg) -> None:
        if self.held is None:
            info = self.client.info
            self.held = HeldBlocks(info.num_kv_blocks if info is not None else 1 << 16)
        self.held.apply(msg)

    async def _pin(self, digest: str, pinned: bool) -> None:
        await self.client.adapter_call("pin" if pinned else "unpin", digest, timeout=30.0)

    def _sync_pins(self) -> None:
        """Bring the engine's pins in line with the hot-adapter leases (in the background, one at a time)."""
        if self._pins is not None and not self._pins.done():
            return
        if self.client.restarts != self._restarts_seen:
            self._restarts_seen = self.client.restarts
            self.hot.engine_restarted()
        stats = self.client.stats
        device = [a["digest"] for a in (stats.adapters if stats else []) if a.get("tier") == "device"]
        if self.client.healthy and (self.hot.leases or self.hot.pinned):
            self._pins = asyncio.ensure_future(self.hot.sync(device))

    # ---- requests --------------------------------------------------------------------------------
    async def generate(
        self, payload: bytes, adapter: LoadedAdapter | None, hot: dict[str, list[str]] | None = None
    ) -> AsyncIterator[bytes]:
        """Run one engine request; yields encoded `StreamItem`s, the replica's id first. `hot`: the
        router's hot adapters per replica (this replica's entry renews their pins' leases)."""
        req = decode_to_engine(payload)
        assert isinstance(req, AddRequest)
        yield _item(self.replica_id)
        self.hot.renew(hot)
        self._sync_pins()
        if not self.client.healthy:  # the engine died and is restarting: let the ingress go elsewhere
            yield _item(self.replica_id, failed="the engine process of this replica is down")
            return
        if req.lora is not None and req.lora.mix:  # a weighted mix: each member from this replica's files
            try:
                members = [(await self._local(lr), w) for lr, w in req.lora.mix]
            except AdapterRefused as exc:
                yield _item(self.replica_id, refused=str(exc))
                return
            except (EngineDeadError, EngineUnavailableError) as exc:
                yield _item(self.replica_id, failed=f"the engine could not load the adapter: {exc}")
                return
            req = msgspec.structs.replace(req, lora=LoRARequest.weighted(members, name=req.lora.name))
        elif req.lora is not None and req.lora.digest is not None:
            try:
                if adapter is None or adapter.digest != req.lora.digest:
                    adapter = await self.resolve(req.lora.digest, req.lora.name)
                elif await self.active(adapter.digest, adapter.name) is None:
                    raise AdapterRefused(f"the adapter {adapter.name!r} is not active")
            except AdapterRefused as exc:
                yield _item(self.replica_id, refused=str(exc))
                return
            except (EngineDeadError, EngineUnavailableError) as exc:
                yield _item(self.replica_id, failed=f"the engine could not load the adapter: {exc}")
                return
            req = msgspec.structs.replace(req, lora=LoRARequest(adapter.name, adapter.path, adapter.digest))
        try:
            async for delta in self.client.generate(req):
                yield _item(self.replica_id, delta=encode(delta))
        except (EngineDeadError, EngineUnavailableError) as exc:
            yield _item(self.replica_id, failed=f"the engine process failed: {exc}")

    def check_health(self) -> None:
        """Raise once the engine process, up before, has died (even if its client has restarted it since):
        Serve's health check then marks this replica unhealthy within a few periods and replaces it with
        a fresh one, instead of routing requests to a replica that cannot answer them."""
        if self._engine_up_once and (not self.client.healthy or self.client.restarts > 0):
            raise RuntimeError("the engine process of this replica died; Serve replaces the replica")

    def routing_stats(self, pool_capacity: int) -> dict[str, Any]:
        """What the affinity router scores this replica by: adapter digests in the device pool and in host
        memory, whether the device pool has a free slot (fewer than `pool_capacity` resident), the KV
        cache's size in blocks and in tokens (the prefix index's bound, the load term's budget),
        `max_num_seqs`, the summary of the blocks its prefix cache holds (`prefix_report`), and the report's
        sequence number (`report`: Serve re-sends every replica's last report whenever one reports, so
        the router tells a new report of this replica by it)."""
        self._sync_pins()  # leases end even without requests
        self._reports += 1
        stats = self.client.stats
        adapters = stats.adapters if stats is not None else []
        device = sorted({a["digest"] for a in adapters if a.get("tier") == "device" and a.get("digest")})
        host = sorted({a["digest"] for a in adapters if a.get("tier") == "cpu" and a.get("digest")})
        blocks = int(stats.engine.get("kv_blocks_total", 0)) if stats is not None else 0
        return {
            "device": device,
            "host": host,
            "free_slot": len(device) < pool_capacity,
            "budget_tokens": max(1, blocks * self.settings.engine.block_size),
            "kv_blocks": blocks or None,  # None until the engine's first stats
            "max_num_seqs": self.settings.engine.max_num_seqs,
            "prefix": self.held.summary().as_stats() if self.held is not None else None,
            "report": self._reports,
        }

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
            "engine_pid": c.pid,
            "data_dir": str(self.data_dir) if self.data_dir is not None else None,
            "loaded_paths": dict(self.loaded_paths),
            "startup_seconds": dict(self.startup_seconds),
            "prefix_blocks_held": len(self.held) if self.held is not None else 0,
            "pinned_hot": sorted(self.hot.pinned),
            "node_id": self.node_id,
            "placement": self.placement,
        }


_encoder = msgspec.msgpack.Encoder()


def _item(
    replica: str, delta: bytes | None = None, refused: str | None = None, failed: str | None = None
) -> bytes:
    return _encoder.encode(StreamItem(replica, delta, refused, failed))


decode_item = msgspec.msgpack.Decoder(StreamItem).decode
