"""`Handoff`: a prefill-only request's KV export, its blocks in Ray's object store.

Prefill replica: `to_object_store(export bytes)` splits the engine's `KVExport` into its state (small,
inline) and its block chunks (one piece or one per layer, as the engine's connector sent them), each put
in the object store by this replica. Decode replica: `from_object_store(handoff, timeout)` fetches the
chunks (zero-copy on one node, Ray's transfer across nodes) and rebuilds the export for its engine,
the blocks inline or (`staging` "shm") written to a shared-memory file its engine reads them from.
The objects are freed once no process holds their refs (the ingress drops its handoff when the request
ends), and lost with their owner, the prefill replica, should it die first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from api.cluster import ray_api
from engine.kv_transfer import KVBlocks, KVExport, TransferState
from engine.kv_transfer.shm_stage import stage, unstage
from engine.kv_transfer.state import decode_export, decode_state, encode_export
from engine.lora_request import LoRARequest


@dataclass(slots=True)
class Handoff:
    request_id: str
    state: bytes  # the encoded `TransferState`
    blocks: bytes  # the encoded `KVBlocks`, without its chunks
    chunks: list[Any]  # ObjectRefs of the chunks, in order
    nbytes: int
    exported_at: float  # time.time() on the prefill replica when its engine exported the blocks

    @property
    def key(self) -> str:
        """Names this handoff on its prefill replica (`PrefillWorker.release`)."""
        return f"{self.request_id}@{self.exported_at}"


_encoder = msgspec.msgpack.Encoder()
_blocks = msgspec.msgpack.Decoder(KVBlocks)


def to_object_store(export_bytes: bytes) -> Handoff:
    """Put the chunks of the engine's encoded `KVExport` in the object store; the rest stays inline."""
    export = decode_export(export_bytes)
    blocks = export.blocks
    if blocks.path is not None:  # an engine configured with the "shm" connector: its file, as one chunk
        with open(blocks.path, "rb") as f:
            blocks = msgspec.structs.replace(blocks, connector="host", chunks=[f.read()], path=None)
        unstage(export.blocks.path)
    # as uint8 arrays: Ray hands them out as zero-copy views of the store on one node (bytes: copied)
    refs = [ray_api.put(np.frombuffer(c, dtype=np.uint8)) for c in blocks.chunks]
    meta = msgspec.structs.replace(blocks, chunks=[])
    return Handoff(
        export.state.request_id,
        encode_export(export.state),
        _encoder.encode(meta),
        refs,
        blocks.nbytes,
        time.time(),
    )


async def from_object_store(
    handoff: Handoff, timeout_s: float, lora: LoRARequest | None, staging: str = "zmq"
) -> tuple[bytes, str | None]:
    """The encoded `KVExport` for this replica's engine, with the adapter's path this replica's own
    (`lora`), and the path of the shared-memory file holding its blocks (None: they are inline).
    `staging` "shm": the chunks are written to a shared-memory file in a worker thread, the export
    names it (connector "shm"), and the caller removes it (`unstage`) once the engine is done with it;
    "zmq": the chunks' bytes are in the export. `TimeoutError` or `ray_api.TransferFailed` when the
    chunks do not come."""
    chunks = await ray_api.get(handoff.chunks, timeout_s)
    state: TransferState = decode_state(handoff.state)
    if lora is not None:
        state = msgspec.structs.replace(state, lora=lora)
    meta = _blocks.decode(handoff.blocks)
    if staging == "shm":
        staging_task = asyncio.ensure_future(
            asyncio.to_thread(stage, meta.layout, meta.num_blocks, meta.num_tokens, chunks)
        )
        try:
            blocks = await asyncio.shield(staging_task)
        except asyncio.CancelledError:  # the waiter is gone: the file the thread still writes goes too
            staging_task.add_done_callback(_unstage_result)
            raise
        return encode_export(KVExport(state, blocks)), blocks.path
    blocks = msgspec.structs.replace(meta, chunks=[bytes(c) for c in chunks])
    return encode_export(KVExport(state, blocks)), None


def _unstage_result(task: asyncio.Future) -> None:
    """Remove the file a staging whose waiter was cancelled wrote (nothing, if the staging failed)."""
    if not task.cancelled() and task.exception() is None:
        unstage(task.result().path)


def adapter_of(handoff: Handoff) -> LoRARequest | None:
    """The adapter the prefill ran with (its path is the prefill replica's)."""
    return decode_state(handoff.state).lora
