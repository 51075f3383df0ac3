"""The prefill and decode deployments: each replica an `EngineReplica` (one engine process).

PrefillReplica.generate(payload): the engine request (prefill-only) as `EngineReplica.generate` runs it;
the engine's last delta (finish "kv_transfer", with the KV export) becomes the first token's delta,
sent at once, then a `Handoff` whose blocks this replica has put in the object store.

DecodeReplica.prepare(digest, name): make the adapter resident here (while the prefill runs); returns
this replica's id. DecodeReplica.decode(target, handoff, digest): fetch the blocks, continue the request
in this engine; yields this replica's id, `FETCHING` once the adapter is resident, a transfer record
(`{"transfer_s", "bytes"}`) once its engine holds the request (it acknowledges the import), then deltas;
or `{"timeout": why}` when the fetch and the import together take longer than the transfer timeout (the
request is then aborted in the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from api.cluster.disaggregated.handoff import Handoff, adapter_of, from_object_store, to_object_store
from api.cluster.replica import AdapterRefused, EngineReplica, LoadedAdapter, _item, decode_item
from api.engine_client import EngineDeadError, EngineUnavailableError
from api.engine_protocol import RequestDelta, decode_from_engine, encode
from engine.kv_transfer.shm_stage import shm_available, sweep_orphans, unstage
from engine.lora_request import LoRARequest
from lora_registry.errors import NotFound

log = logging.getLogger("loraplex.disaggregated")
FETCHING = {"fetching": True}  # a decode call's item once its adapter is resident, before the fetch


class PrefillWorker:
    """What a prefill replica does, around its `EngineReplica`."""

    def __init__(self, replica: EngineReplica, hold_s: float = 30.0) -> None:
        self.replica = replica
        self.exports = 0
        # the chunks' ObjectRefs of recent handoffs, kept `hold_s` (the transfer timeout): this replica
        # owns the objects, and Ray may delete them once its own refs are gone before the ingress's and
        # the decode replica's borrows of the refs nested in the streamed handoff are registered
        self.hold_s = hold_s
        self.held: dict[str, list[Any]] = {}

    async def generate(self, payload: bytes) -> AsyncIterator[Any]:
        async for raw in self.replica.generate(payload, None):
            item = decode_item(raw)
            if item.delta is None:
                yield raw
                continue
            delta = decode_from_engine(item.delta)
            if not isinstance(delta, RequestDelta) or delta.kv_export is None:
                yield raw
                continue
            first = msgspec.structs.replace(delta, finish_reason=None, kv_export=None)
            yield _item(self.replica.replica_id, delta=encode(first))  # the first token, before the KV
            handoff = await asyncio.to_thread(to_object_store, delta.kv_export)
            self.exports += 1
            self._hold(handoff)
            yield handoff

    def _hold(self, handoff: Handoff) -> None:
        """Keep `handoff`'s chunks referenced here until the decode replica's engine acknowledged their
        import (`release`), at most `hold_s` (the transfer timeout: by then it is cancelled anyway)."""
        self.held[handoff.key] = handoff.chunks
        asyncio.get_running_loop().call_later(self.hold_s, self.held.pop, handoff.key, None)

    def release(self, key: str) -> bool:
        """Drop this replica's refs of the handoff `key` (its blocks were imported); False when it does
        not hold them (another prefill replica's, or released already)."""
        return self.held.pop(key, None) is not None


@contextlib.asynccontextmanager
async def _unstaged(path: str | None) -> AsyncIterator[None]:
    """Remove the staged blocks' file on leaving (the engine has copied them, refused them, or the
    request ended)."""
    try:
        yield
    finally:
        unstage(path)


class DecodeWorker:
    """What a decode replica does, around its `EngineReplica`."""

    def __init__(self, replica: EngineReplica, transfer_timeout_s: float, staging: str = "shm") -> None:
        self.replica = replica
        self.transfer_timeout_s = transfer_timeout_s
        # how the fetched blocks reach this replica's engine: "shm" (a shared-memory file the engine
        # copies from; none of their bytes on this event loop or the engine's socket) or "zmq" (inline)
        self.staging = staging if staging != "shm" or shm_available() else "zmq"
        if self.staging == "shm":
            sweep_orphans()  # the files of a replica that died mid-transfer (this one may replace it)
        self.imports = 0  # handoffs whose blocks this replica fetched
        self.timeouts = 0  # transfers cancelled past `transfer_timeout_s`
        self.prepared = 0
        self.ready: set[str] = set()  # adapter digests `prepare` made resident here
        # adapters a decode call had to load itself (not prepared here while the prefill ran)
        self.late_loads = 0
        self.decode_adds = 0  # adapter calls a decode call made to the engine (none for a prepared one)

    async def prepare(
        self, digest: str | None, name: str | None, members: list[tuple[str, str]] | None = None
    ) -> dict[str, Any]:
        """Make the adapter `digest` (or a weighted mix's `members`, (digest, name) pairs) resident here;
        {"replica": id} and "refused"/"failed" if it cannot."""
        out: dict[str, Any] = {"replica": self.replica.replica_id}
        wanted = list(members or []) or ([(digest, name or "")] if digest else [])
        if wanted:
            try:
                for d, n in wanted:
                    await self._load(d, n or None)
                    self.ready.add(d)
            except AdapterRefused as exc:
                out["refused"] = str(exc)
            except (EngineDeadError, EngineUnavailableError, ValueError) as exc:
                out["failed"] = f"the engine could not load the adapter: {exc}"
        self.prepared += 1
        return out

    async def decode(self, handoff: Handoff) -> AsyncIterator[Any]:
        """Continue `handoff` in this engine: this replica's id, `FETCHING` (its adapter resident), a
        transfer record (`{"transfer_s", "bytes"}`) once the engine holds the request and its blocks,
        then the engine's deltas. The fetch
        and the engine's import together get `transfer_timeout_s`; past it, `{"timeout": why}` ends the
        stream, and leaving the import's stream aborts the request in the engine (its blocks and its
        adapter hold freed as soon as the engine reads the abort, however late)."""
        rid = self.replica.replica_id
        yield _item(rid)
        client = self.replica.client
        if not client.healthy:
            yield _item(rid, failed="the engine process of this replica is down")
            return
        try:
            mine = await self._local(adapter_of(handoff))
        except AdapterRefused as exc:  # no version of the registry has this content
            yield _item(rid, failed=str(exc))
            return
        except (EngineDeadError, EngineUnavailableError, ValueError) as exc:
            yield _item(rid, failed=f"the engine could not load the adapter: {exc}")
            return
        yield FETCHING  # the adapter is here: the transfer's own clock starts (the ingress's too)
        t0 = time.monotonic()
        timeout = self.transfer_timeout_s
        stalled = {"timeout": f"the KV transfer did not complete within {timeout:g} s; it was cancelled"}
        try:
            export, staged = await from_object_store(handoff, timeout, mine, self.staging)
        except TimeoutError:
            self.timeouts += 1
            yield stalled
            return
        except Exception as exc:  # the prefill replica (the objects' owner) died
            yield _item(rid, failed=f"the KV transfer failed: {exc}")
            return
        self.imports += 1
        deltas = client.import_generate(handoff.request_id, export)
        try:
            async with contextlib.aclosing(deltas), _unstaged(staged):
                try:
                    ack = await asyncio.wait_for(anext(deltas), max(0.0, t0 + timeout - time.monotonic()))
                except TimeoutError:
                    self.timeouts += 1
                    yield stalled
                    return
                if not ack.imported:  # the engine refused the import: its error ends the request
                    yield _item(rid, delta=encode(ack))
                    return
                unstage(staged)  # the engine copied the blocks into its cache before acknowledging
                yield {"transfer_s": time.monotonic() - t0, "bytes": handoff.nbytes}
                async for delta in deltas:
                    yield _item(rid, delta=encode(delta))
        except StopAsyncIteration:
            yield _item(rid, failed="the engine ended the import without a delta")
        except (EngineDeadError, EngineUnavailableError) as exc:
            yield _item(rid, failed=f"the engine process failed: {exc}")

    async def _local(self, lora: LoRARequest | None) -> LoRARequest | None:
        """The prefill's adapter (or weighted mix) as this replica's engine reads it: its files here.
        Counts in `late_loads` each adapter not prepared here first (a failed or timed-out `prepare`)."""
        if lora is None:
            return None
        self.late_loads += sum(
            1 for m, _ in lora.members() if m.digest is not None and m.digest not in self.ready
        )
        if lora.mix:
            members = []
            for member, weight in lora.mix:
                if member.digest is None:
                    raise AdapterRefused(f"the adapter {member.name!r} has no content digest")
                loaded = await self._load_for_decode(member.digest, member.name)
                members.append((LoRARequest(loaded.name, loaded.path, loaded.digest), weight))
            return LoRARequest.weighted(members, name=lora.name)
        if lora.digest is None:
            return lora
        loaded = await self._load_for_decode(lora.digest, lora.name)
        return LoRARequest(loaded.name, loaded.path, loaded.digest)

    async def _load_for_decode(self, digest: str, name: str | None) -> LoadedAdapter:
        """The adapter `digest` for a decode call: one `prepare` made resident here is only looked up
        (its files here), with no call to the engine, whose step loop would answer it between steps."""
        prepared = digest in self.ready
        if not prepared:
            self.decode_adds += 1
        return await self._load(digest, name, engine=not prepared)

    async def _load(self, digest: str, name: str | None, engine: bool = True) -> LoadedAdapter:
        """Make the adapter `digest` resident here (`engine` False: `prepare` already made it so; only
        its files here are looked up). One deactivated since the prefill admitted the request still loads
        by its digest (versions are immutable): admitted requests finish on their version."""
        try:
            if not engine:
                return await self.replica.resolve(digest, name)
            return await self.replica.load(digest, name)
        except AdapterRefused:
            registry = self.replica.registry
            assert registry is not None
            try:
                path = await asyncio.to_thread(registry.adapters.adapter_path, digest)
            except NotFound as exc:
                raise AdapterRefused(f"the adapter {name or digest!r} is not in the registry") from exc
            await self.replica.client.adapter_call("add", name or digest, str(path), digest)
            return LoadedAdapter(name or digest, digest, str(path))

    def routing_stats(self, pool_capacity: int) -> dict[str, Any]:
        stats = self.replica.routing_stats(pool_capacity)
        st = self.replica.client.stats
        stats["kv_free"] = int(st.engine.get("kv_blocks_free", 0)) if st is not None else None
        return stats
