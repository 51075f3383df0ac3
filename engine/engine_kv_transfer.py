"""The engine's side of prefill/decode disaggregation: continue another engine's prefill-only request
from its KV export, and end a prefill-only request of this engine with its export.

The export format and block placement are engine/kv_transfer/export_import.py; this module ties them to
the engine's request table, scheduler and detokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from engine.kv_transfer import KV_TRANSFER_FINISH, KVExport
from engine.kv_transfer.export_import import (
    check_layout,
    export_sequence,
    imported_sequence,
    receive_blocks,
    reserve_blocks,
)
from engine.output_processor import SequenceText
from engine.outputs import RequestOutput
from engine.request_admission import max_total, sequence_text
from engine.request_group import RequestGroup
from engine.request_tokens import resolve_request_tokens
from engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


@dataclass
class PendingImport:
    """An import whose sequence holds its blocks while their K/V are being received (`begin_import`);
    `finish_import` queues it once `copy` is done."""

    seq: Sequence
    prompt_ids: list[int]
    text: SequenceText | None
    copy: Future[None] | None  # the blocks' receiving; None: the pool had no room (prompt recomputed)

    def done(self) -> bool:
        return self.copy is None or self.copy.done()


def import_request(engine: LLMEngine, export: KVExport) -> bool:
    """Queue `export`'s request on `engine` (`LLMEngine.import_request`): its state, its output text so
    far, and its prompt K/V placed in the KV pool. Returns False when the pool had no room and the prompt
    is recomputed instead; raises `ValueError` for an export `engine` cannot continue."""
    return finish_import(engine, begin_import(engine, export))


def begin_import(engine: LLMEngine, export: KVExport, copier: Executor | None = None) -> PendingImport:
    """Check `export` against `engine`, build its sequence and reserve its blocks; the blocks' K/V are
    received inline, or in `copier` (a worker thread, so the step loop goes on meanwhile) when given
    and the cache is in host memory. Raises `ValueError` for an export `engine` cannot continue."""
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
    text = sequence_text(engine.tokenizer, engine.config.detokenize, params)
    reserved = reserve_blocks(engine, seq, export)
    copy = None
    if reserved is not None:
        args = (engine, export, engine.kv_connector, *reserved)
        if copier is not None and engine.runner.kv_cache.device.type == "cpu":
            copy = copier.submit(receive_blocks, *args)
        else:
            copy = _run_inline(receive_blocks, *args)
    return PendingImport(seq, ids, text, copy)


def _run_inline(fn: Callable[..., None], *args: Any) -> Future[None]:
    """`fn(*args)` run now, as a done future holding what it raised (so `finish_import` frees the blocks
    of an inline copy that failed as it does a worker thread's)."""
    fut: Future[None] = Future()
    try:
        fn(*args)
    except Exception as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(None)
    return fut


def finish_import(engine: LLMEngine, pending: PendingImport) -> bool:
    """Queue a begun import whose K/V are received (`pending.done()`); returns whether its blocks were
    placed (False: its prompt is recomputed). Raises what the copy raised, having freed the blocks."""
    seq = pending.seq
    placed = pending.copy is not None
    if pending.copy is not None:
        try:
            pending.copy.result()
        except Exception:
            engine.kv.free(seq)
            raise
        seq.num_computed_tokens = seq.num_prompt_tokens
    rid = seq.seq_id
    if rid in engine.requests:  # another request took the id while the blocks were copied
        engine.kv.free(seq)
        raise ValueError(f"request id {rid!r} is already in use")
    text = pending.text
    if text is not None:
        for tok in seq.output_token_ids:
            text.accept(tok, None)
        seq.text = text.text
    engine.requests.add(RequestGroup(rid, None, pending.prompt_ids, [seq], [text], 1))
    engine.scheduler.add_request(seq)
    engine.counters.prompt_tokens += len(pending.prompt_ids)
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
