"""Grammars compile off the engine's step loop (issue 25, item 3): the engine-core loop (`_EngineLoop`,
driven over real ZeroMQ sockets in this process) keeps stepping a plain request while a hard grammar
compiles in a worker thread, and a grammar refused by its dry run is a 400, never a 500 mid-decoding."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from api.engine_core import _EngineLoop, _ParentWatch
from api.engine_protocol import AddRequest, RequestDelta, Shutdown, decode_from_engine, encode
from engine import LLMEngine, SamplingParams
from engine.structured import StructuredSpec


@pytest.fixture
def loop(checkpoint):
    """(send(msg), deltas(): list of (seconds since start, RequestDelta)) of a running engine loop."""
    engine = LLMEngine.from_args(
        checkpoint("llama", tokenizer=True, vocab_size=100), device="cpu", dtype="float32", num_kv_blocks=96
    )
    ctx = zmq.Context()
    tag = f"{os.getpid()}-{id(engine)}"
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind(f"inproc://in-{tag}")
    from_engine.bind(f"inproc://out-{tag}")
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"inproc://in-{tag}")
    push.connect(f"inproc://out-{tag}")
    watch = _ParentWatch(os.getpid())
    runner = threading.Thread(target=_EngineLoop(engine, pull, push, 60.0, watch).run, daemon=True)
    runner.start()
    t0 = time.perf_counter()
    got: list[tuple[float, RequestDelta]] = []

    def deltas(until: set[str], timeout: float = 120.0) -> list[tuple[float, RequestDelta]]:
        """Every delta until each request in `until` has finished."""
        deadline = time.monotonic() + timeout
        while until - {d.request_id for _, d in got if d.finish_reason is not None}:
            assert time.monotonic() < deadline, "the engine loop did not finish the requests"
            if from_engine.poll(100):
                msg = decode_from_engine(from_engine.recv())
                if isinstance(msg, RequestDelta):
                    got.append((time.perf_counter() - t0, msg))
        return got

    yield to_engine.send, deltas
    to_engine.send(encode(Shutdown()))
    runner.join(30)
    watch.close()
    for s in (to_engine, from_engine, pull, push):
        s.close(linger=0)
    ctx.term()


def _hard_schema() -> dict:
    """Valid, ~50 KiB, and a good fraction of a second to compile and dry-run."""
    names = [f"k{i}" for i in range(2400)]
    return {"type": "object", "properties": {k: {} for k in names}, "required": names}


def test_plain_request_keeps_stepping_while_a_hard_grammar_compiles(loop):
    send, deltas = loop
    hard = SamplingParams(max_tokens=2, structured=StructuredSpec.json_schema(_hard_schema()))
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    send(encode(AddRequest("hard", [5, 6, 7], hard)))
    send(encode(AddRequest("plain", [8, 9, 10], plain)))
    got = deltas({"hard", "plain"})
    hard_first = min(t for t, d in got if d.request_id == "hard" and (d.token_ids or d.finish_reason))
    plain_before = sum(len(d.token_ids) for t, d in got if d.request_id == "plain" and t < hard_first)
    assert not [d.error for _, d in got if d.error]
    # Compiled on the loop, the hard request blocked it: both started in the same step. Now the plain
    # request decodes (about a step per token) for as long as the compile takes.
    assert plain_before >= 8, (plain_before, hard_first)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2500)}},
    ],
    ids=["ref-root", "2500-optional-properties"],
)
def test_grammar_refused_by_its_dry_run_is_a_400_before_it_runs(loop, schema):
    send, deltas = loop
    params = SamplingParams(max_tokens=8, structured=StructuredSpec.json_schema(schema))
    send(encode(AddRequest("bad", [5, 6, 7], params)))
    ((_, delta),) = deltas({"bad"})
    assert delta.finish_reason == "error" and delta.error_status == 400, delta
    assert delta.token_ids == [] and "unsupported json_schema" in (delta.error or "")
