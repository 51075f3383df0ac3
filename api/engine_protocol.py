"""Messages between the API process and the engine-core process (msgpack over ZeroMQ).

API -> engine: `AddRequest`, `AbortRequests`, `AdapterCall`, `Shutdown`.
Engine -> API: `Ready` once loaded, `RequestDelta` as tokens are produced, `CallResult` for each
`AdapterCall`, and `EngineStatsMsg` a few times a second.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.lora_request import LoRARequest
from engine.sampling_params import PRIORITY_BOUND, SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    """One engine sequence to run. `params` and `lora` are the engine's own typed contract: decoding
    checks every field's declared range again (`SamplingParams.__post_init__`), so the engine never trusts
    the wire. The API sends one `AddRequest` per choice (`params.n == 1`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    priority: int = 0
    # prefill/decode disaggregation: end after the first token with the prompt's KV (`RequestDelta.kv_export`)
    prefill_only: bool = False

    def __post_init__(self) -> None:
        if not PRIORITY_BOUND.holds(self.priority):
            raise ValueError(f"priority must be in {PRIORITY_BOUND.describe()}")


class ImportRequest(msgspec.Struct, tag="import"):
    """Continue another engine's prefill-only request: `export` is its encoded
    `engine.kv_transfer.KVExport` (state + KV blocks); its deltas follow the transferred tokens."""

    request_id: str
    export: bytes


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class AdapterCall(msgspec.Struct, tag="adapter"):
    """`op`: "add" (load + validate now), "prefetch" (load in the background), "remove", "pin", "unpin".
    `keep` (for "remove"): digests still served under other names, whose pool entries must stay."""

    call_id: int
    op: str
    name: str
    path: str | None = None
    digest: str | None = None
    keep: list[str] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    device: str
    dtype: str
    lora_backend: str = ""  # how LoRA is applied: "native", "torch", "triton" ("" when LoRA is off)
    lora_dtype: str = ""  # the adapter pool's dtype
    dtype_reason: str = ""  # why the model runs in `dtype` (e.g. auto on a CPU with native bfloat16)
    cuda_graphs: int = 0  # decode graphs captured at start (engine/decode_graphs.py; 0: steps run eagerly)
    graph_capture_s: float = 0.0  # the wall time their capture took
    graph_memory_bytes: int = 0  # the device memory they hold


class RequestDelta(msgspec.Struct, tag="delta"):
    """New tokens of one request since the last delta; `logprobs[i]` = [(token, logprob, rank), ...]
    with the chosen token first."""

    request_id: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500  # HTTP status for `error`: 400 when the engine refused the request itself
    kv_export: bytes | None = None  # finish "kv_transfer": the encoded `engine.kv_transfer.KVExport`
    # an `ImportRequest`'s first delta (no tokens): the engine holds the request and its KV blocks now
    imported: bool = False


class CallResult(msgspec.Struct, tag="result"):
    call_id: int
    ok: bool
    value: Any = None
    error: str | None = None


class EngineStatsMsg(msgspec.Struct, tag="stats"):
    engine: dict[str, Any]
    lora: dict[str, Any] | None
    adapters: list[dict[str, Any]]


class KVEventsMsg(msgspec.Struct, tag="kv_events"):
    """The block hashes the engine's prefix cache stored and evicted since its previous message
    (`engine.kv_cache.cache_events`); `reset`: `stored` is everything cached now. Sent before each stats
    message by an engine made with `kv_events=True`."""

    reset: bool
    stored: list[bytes]
    removed: list[bytes]


ToEngine = AddRequest | ImportRequest | AbortRequests | AdapterCall | Shutdown
FromEngine = Ready | RequestDelta | CallResult | EngineStatsMsg | KVEventsMsg

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    """The message in `data`; `InvalidMessage` (with the request id when one can be read) if it breaks
    the contract, e.g. an out-of-range sampling field."""
    try:
        return _to_engine.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise InvalidMessage(str(exc), _request_id(data)) from exc


class InvalidMessage(ValueError):
    """A message to the engine that does not decode into the contract."""

    def __init__(self, message: str, request_id: str | None) -> None:
        super().__init__(message)
        self.request_id = request_id


class _AnyAdd(msgspec.Struct, tag="add"):
    request_id: str


def _request_id(data: bytes) -> str | None:
    try:
        return msgspec.msgpack.decode(data, type=_AnyAdd).request_id
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
