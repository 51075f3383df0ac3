"""What a prefill-only request hands to the engine that continues it, as plain data (msgpack-able).

`TransferState` is everything the decode side needs besides the KV: the prompt, the tokens the prefill
sampled (the first one), their log-probabilities, the sampling parameters, the adapter (its content
digest keys the prefix cache on both sides). A seeded request needs no generator state: its noise is a
function of `params.seed` (the choice's seed) and the output position (`engine/sampling_noise.py`), so
the decode side continues the same stream as one engine would have. A structured-output request's grammar
state is the tokens accepted so far: the decode side compiles the same spec (cached) and replays them.
"""

from __future__ import annotations

import msgspec

from engine.kv_transfer.connector import KVBlocks
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams

# The finish reason of a prefill-only request whose KV was exported (it goes on elsewhere).
KV_TRANSFER_FINISH = "kv_transfer"

LogprobEntry = list[tuple[int, float, int]]  # (token, logprob, rank), the chosen token first


class TransferState(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    lora_key: str | None = None  # the adapter digest the prefill side keyed its blocks with
    priority: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache
    cumulative_logprob: float = 0.0
    logprobs: list[LogprobEntry] | None = None


class KVExport(msgspec.Struct):
    """A prefill-only request's result: its state and its prompt's KV blocks."""

    state: TransferState
    blocks: KVBlocks


_encoder = msgspec.msgpack.Encoder()
_export = msgspec.msgpack.Decoder(KVExport)
_state = msgspec.msgpack.Decoder(TransferState)


def encode_export(export: KVExport | TransferState) -> bytes:
    return _encoder.encode(export)


def decode_export(data: bytes) -> KVExport:
    """The export in `data`; ValueError when it is not one (a sampling field out of range included)."""
    try:
        return _export.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"malformed KV export: {exc}") from exc


def decode_state(data: bytes) -> TransferState:
    try:
        return _state.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"malformed transfer state: {exc}") from exc
