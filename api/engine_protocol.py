"""Messages between the API process and the engine-core process (msgpack over ZeroMQ).

API -> engine: `AddRequest`, `AbortRequests`, `AdapterCall`, `Shutdown`.
Engine -> API: `Ready` once loaded, `RequestDelta` as tokens are produced, `CallResult` for each
`AdapterCall`, and `EngineStatsMsg` a few times a second.
"""

from __future__ import annotations

from typing import Any

import msgspec


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    lora_name: str | None = None
    lora_path: str | None = None
    lora_digest: str | None = None
    priority: int = 0


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class AdapterCall(msgspec.Struct, tag="adapter"):
    """`op`: "add" (load + validate now), "prefetch" (load in the background), "remove", "pin", "unpin"."""

    call_id: int
    op: str
    name: str
    path: str | None = None
    digest: str | None = None


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


class RequestDelta(msgspec.Struct, tag="delta"):
    """New tokens of one request since the last delta; `logprobs[i]` = [(token, logprob, rank), ...]
    with the chosen token first."""

    request_id: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class CallResult(msgspec.Struct, tag="result"):
    call_id: int
    ok: bool
    value: Any = None
    error: str | None = None


class EngineStatsMsg(msgspec.Struct, tag="stats"):
    engine: dict[str, Any]
    lora: dict[str, Any] | None
    adapters: list[dict[str, Any]]


ToEngine = AddRequest | AbortRequests | AdapterCall | Shutdown
FromEngine = Ready | RequestDelta | CallResult | EngineStatsMsg

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
