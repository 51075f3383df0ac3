"""The engine's two ends of a KV transfer: export a prefill-only sequence, import one to decode.

Export (prefill side, right after the step that sampled the first token):
    blocks = connector.send(the blocks holding the prompt's K/V)
    state  = prompt, sampled tokens, logprobs, params, adapter, the seed in params (the noise is per position)
Import (decode side): a `Sequence` with the prompt and those tokens, `num_computed_tokens` = prompt
length, whose block table is this engine's own cached prefix blocks (same digest-salted chain) plus
fresh blocks (`reserve_blocks`) filled by `connector.receive` (`receive_blocks`, which the engine loop
runs in a worker thread while steps go on). It waits in the queue like any request; admission computes
only its last sampled token and registers every full prompt block in the prefix cache, so a follow-up
turn hits. With no free blocks it is queued to recompute the prompt instead (as after a preemption).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.kv_transfer.connector import KVBlocks, KVConnector, KVLayout, receiver_for
from engine.kv_transfer.state import KVExport, TransferState
from engine.outputs import Logprob
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def export_sequence(engine: LLMEngine, seq: Sequence, connector: KVConnector) -> KVExport:
    """The transfer of `seq` (its prompt computed, its first token sampled): blocks sent, state taken."""
    n = seq.num_prompt_tokens
    assert seq.num_computed_tokens >= n, "exported before the prompt was computed"
    block_ids = engine.kv.block_ids(seq)[: engine.kv.blocks_needed(n)]
    blocks = connector.send(seq.seq_id, engine.runner.kv_cache, block_ids, n)
    logprobs = None
    if seq.logprobs is not None:
        logprobs = [
            sorted(((t, lp.logprob, lp.rank) for t, lp in entry.items()), key=lambda e: e[0] != tok)
            for tok, entry in zip(seq.output_token_ids, seq.logprobs, strict=True)
        ]
    state = TransferState(
        request_id=seq.seq_id,
        prompt_token_ids=list(seq.prompt_token_ids),
        output_token_ids=list(seq.output_token_ids),
        params=seq.params,
        lora=seq.lora_request,
        lora_key=seq.lora_key,
        priority=seq.priority,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=logprobs,
    )
    return KVExport(state, blocks)


def check_layout(blocks: KVBlocks, kv_cache: torch.Tensor) -> None:
    """ValueError unless `blocks` hold K/V laid out as this engine's cache holds them."""
    mine = KVLayout.of(kv_cache)
    if blocks.layout != mine:
        raise ValueError(f"the KV blocks' layout {blocks.layout} does not match this engine's {mine}")


def imported_sequence(engine: LLMEngine, state: TransferState, max_total: int) -> Sequence:
    """A `Sequence` continuing `state`: prompt and sampled tokens, logprobs, grammar replayed (a seeded
    request's noise is a function of its seed and output position: it continues the same stream).
    ValueError when the adapter this engine resolves differs from the one the prefill used."""
    lora_key, lora_keys = engine.adapters.key_for(state.lora)
    if state.lora_key is not None and lora_key is not None and lora_key != state.lora_key:
        raise ValueError("the adapter's content differs between the prefill and the decode engine")
    seq = Sequence(
        state.request_id,
        list(state.prompt_token_ids),
        state.params,
        time.monotonic(),
        state.priority,
        state.lora,
        lora_key,
        max_total,
    )
    seq.lora_keys = lora_keys
    engine.structured.attach(seq)
    for tok in state.output_token_ids:
        seq.append_token(tok)
        if seq.structured is not None and not seq.structured.consume_token(tok):
            raise ValueError("the transferred tokens do not match the request's grammar")
    seq.cumulative_logprob = state.cumulative_logprob
    if seq.logprobs is not None and state.logprobs is not None:
        seq.logprobs = [{t: Logprob(lp, rank) for t, lp, rank in entry} for entry in state.logprobs]
    seq.num_cached_tokens = state.num_cached_tokens
    seq.first_token_time = time.monotonic()
    return seq


def reserve_blocks(engine: LLMEngine, seq: Sequence, export: KVExport) -> tuple[list[int], int] | None:
    """Give `seq` the blocks for its prompt's K/V: its cached prefix here plus fresh ones. Returns (the
    fresh blocks' ids, how many prefix blocks were cached) for `receive_blocks` to fill, or None (and
    nothing held) when the pool has no room: the sequence then recomputes its prompt when admitted."""
    n = seq.num_prompt_tokens
    check_layout(export.blocks, engine.runner.kv_cache)
    if export.blocks.num_tokens != n or export.blocks.num_blocks != engine.kv.blocks_needed(n):
        raise ValueError(
            f"KV export holds {export.blocks.num_blocks} blocks for {export.blocks.num_tokens} tokens; "
            f"the prompt has {n} tokens"
        )
    placed = engine.kv.import_blocks(seq, n)
    if placed is None:
        return None
    block_ids, first = placed
    return block_ids[first:], first


def receive_blocks(
    engine: LLMEngine, export: KVExport, connector: KVConnector, block_ids: list[int], first: int
) -> None:
    """Fill this engine's blocks `block_ids` with the export's blocks `first, ...` (its connector's copy;
    the blocks belong to a sequence no step reads yet, so a worker thread may run this between steps)."""
    receiver_for(export.blocks, connector).receive(export.blocks, engine.runner.kv_cache, block_ids, first)
