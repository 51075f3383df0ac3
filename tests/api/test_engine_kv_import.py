"""The engine process's side of disaggregation, over its real ZeroMQ protocol (no Ray): a prefill-only
`AddRequest` ends with the first token and the KV export; an `ImportRequest` on another engine process
continues it, giving the tokens one engine gives (base model and a structured-output request whose
grammar compiles in the engine's worker thread), after an acknowledgement of the import; a malformed
export is refused with 400."""

from __future__ import annotations

import asyncio

from api.engine_client import EngineClient
from api.engine_protocol import AddRequest
from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.kv_transfer import KV_TRANSFER_FINISH
from engine.structured import StructuredSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


async def _collect(stream) -> tuple[list[int], list]:
    toks, deltas = [], []
    async for d in stream:
        toks += d.token_ids
        deltas.append(d)
    return toks, deltas


def test_prefill_export_then_import_in_another_engine_process(text_model) -> None:
    cfg = EngineConfig(
        model=str(text_model[0]), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4
    )
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    structured = SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredSpec.json_schema(SCHEMA))
    cases = {
        "plain": ([5, 9, 14, 3, 22, 7, 8, 41, 2, 60, 11], greedy),
        "json": ([7, 8, 9, 10, 11], structured),
    }

    async def run() -> None:
        pre, dec = EngineClient(cfg), EngineClient(cfg)
        await asyncio.gather(pre.start(), dec.start())
        try:
            for rid, (prompt, params) in cases.items():
                want, _ = await _collect(pre.generate(AddRequest(f"{rid}-one", prompt, params)))
                first, deltas = await _collect(
                    pre.generate(AddRequest(rid, prompt, params, prefill_only=True))
                )
                last = deltas[-1]
                assert last.finish_reason == KV_TRANSFER_FINISH and last.kv_export and len(first) == 1
                rest, rdeltas = await _collect(dec.import_generate(rid, last.kv_export))
                assert first + rest == want, rid
                # the engine acknowledges the import (it holds the request and its blocks) before any token
                assert rdeltas[0].imported and not rdeltas[0].token_ids and rdeltas[0].finish_reason is None
                assert not any(d.imported for d in rdeltas[1:])
                assert rdeltas[-1].finish_reason in ("stop", "length")
            _, bad = await _collect(dec.import_generate("bad", b"not an export"))
            assert bad[-1].finish_reason == "error" and bad[-1].error_status == 400
            assert not any(d.imported for d in bad)  # refused: never acknowledged
            await asyncio.sleep(1.2)  # a stats message after the last request
            for c in (pre, dec):
                assert c.stats is not None and c.stats.engine["kv_blocks_used"] == 0
        finally:
            await asyncio.gather(pre.shutdown(), dec.shutdown())

    asyncio.run(run())
