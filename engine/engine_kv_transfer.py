"""The engine's side of prefill/decode disaggregation: continue another engine's prefill-only request
from its KV export, and end a prefill-only request of this engine with its export.

The export format and block placement are engine/kv_transfer/export_import.py; this module ties them to
the engine's request table, scheduler and detokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from engine.kv_transfer import KV_TRANSFER_FINISH, KVExport
from engine.kv_transfer.export_import import (
    check_layout,
    export_sequence,
    imported_sequence,
    place_blocks,
)
from engine.outputs import RequestOutput
from engine.request_admission import max_total, sequence_text
from engine.request_group import RequestGroup
from engine.request_tokens import resolve_request_tokens
from engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def import_request(engine: LLMEngine, export: KVExport) -> bool:
    """Queue `export`'s request on `engine` (`LLMEngine.import_request`): its state, its output text so
    far, and its prompt K/V placed in the KV pool. Returns False when the pool had no room and the prompt
    is recomputed instead; raises `ValueError` for an export `engine` cannot continue."""
    st = export.state
    if engine.tp is not None:
        raise ValueError("KV transfer needs an engine of one rank (tensor_parallel_size 1)")
    check_layout(export.blocks, engine.runner.kv_cache)
    params = resolve_request_tokens(st.params, engine.tokenizer, engine.model_config.vocab_size)
    engine.structured.check(params)
    if st.request_id in engine.requests:
        raise ValueError(f"request id {st.request_id!r} is already in use")
    if len(params.choices()) != 1 or not st.output_token_ids:
        raise ValueError("a KV import continues one sequence that has sampled its first token")
    _, ids = engine.tokenize(st.prompt_token_ids)
    engine.tokenize(st.output_token_ids)  # token ids in the vocabulary
    limit = max_total(len(ids), params, engine.model_config.max_model_len, engine.kv)
    seq = imported_sequence(engine, msgspec.structs.replace(st, params=params), limit)
    placed = place_blocks(engine, seq, export, engine.kv_connector)
    text = sequence_text(engine.tokenizer, engine.config.detokenize, params)
    if text is not None:
        for tok in seq.output_token_ids:
            text.accept(tok, None)
        seq.text = text.text
    engine.requests.add(RequestGroup(st.request_id, None, ids, [seq], [text], 1))
    engine.scheduler.add_request(seq)
    engine.counters.prompt_tokens += len(ids)
    return placed


def export_request(engine: LLMEngine, group: RequestGroup, out: RequestOutput) -> RequestOutput:
    """End prefill-only `group` after its first token: `out` with its KV export, finish "kv_transfer"
    (its blocks stay cached on `engine` until the receiver releases the transfer)."""
    seq = group.seqs[0]
    out.kv_export = export_sequence(engine, seq, engine.kv_connector)
    engine.scheduler.finish_request(seq, SequenceStatus.FINISHED_ABORTED)
    out.finished = True
    out.outputs[0].finish_reason = KV_TRANSFER_FINISH
    return out
