"""The engine loop fills an imported request's KV blocks in its copier thread while steps go on
(api/engine_core.py `_EngineLoop`, engine/engine_kv_transfer.py `begin_import` / `finish_import`).

Driven in process, with the loop's sockets replaced by lists and its copier by one that runs a copy
only when told, so each test holds an import mid-copy: other requests keep stepping, the import is
acknowledged only once its blocks are filled, and it then gives the tokens one engine gives; an abort
or a failed copy mid-copy leaves no block held."""

from __future__ import annotations

import glob
import os
from concurrent.futures import Executor, Future

import pytest

from api.engine_core import _EngineLoop, _ParentWatch
from api.engine_protocol import AbortRequests, ImportRequest, RequestDelta, decode_from_engine
from engine import LLMEngine, SamplingParams
from engine.kv_transfer.shm_stage import PREFIX, SHM_DIR, unstage
from engine.kv_transfer.state import encode_export

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 31))  # 21 tokens: 6 blocks


class HeldCopier(Executor):
    """Runs each submitted call only at `release()`, so a test decides when a copy happens."""

    def __init__(self) -> None:
        self.held: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, /, *args, **kwargs):
        fut: Future = Future()
        self.held.append((fut, fn, args))
        return fut

    def release(self) -> None:
        for fut, fn, args in self.held:
            try:
                fut.set_result(fn(*args))  # type: ignore[operator]
            except Exception as exc:  # the loop sees it as a worker thread's failure
                fut.set_exception(exc)
        self.held.clear()


class Sent:
    """The loop's push socket: every message it sent, decoded."""

    def __init__(self) -> None:
        self.msgs: list[RequestDelta] = []

    def send(self, data: bytes) -> None:
        msg = decode_from_engine(data)
        if isinstance(msg, RequestDelta):
            self.msgs.append(msg)

    def of(self, rid: str) -> list[RequestDelta]:
        return [m for m in self.msgs if m.request_id == rid]


def _engine(base) -> LLMEngine:
    return LLMEngine.from_args(
        str(base), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64, kv_connector="shm"
    )


@pytest.fixture(autouse=True)
def _unstage_files():
    """Remove the files this test's exports staged (their writer's job once the import is done)."""
    before = set(glob.glob(f"{SHM_DIR}/{PREFIX}{os.getpid()}-*"))
    yield
    for path in set(glob.glob(f"{SHM_DIR}/{PREFIX}{os.getpid()}-*")) - before:
        unstage(path)


@pytest.fixture
def watch():
    """The loop's parent watch (this process; a pidfd, closed after the test)."""
    w = _ParentWatch(os.getpid())
    yield w
    w.close()


def _loop(engine: LLMEngine, watch: _ParentWatch) -> tuple[_EngineLoop, Sent, HeldCopier]:
    sent, copier = Sent(), HeldCopier()
    loop = _EngineLoop(engine, None, sent, 60.0, watch)
    loop.copier.shutdown()
    loop.copier = copier  # type: ignore[assignment]
    return loop, sent, copier


def _export(pre: LLMEngine, rid: str) -> bytes:
    pre.add_request(rid, PROMPT, GREEDY, prefill_only=True)
    while pre.has_unfinished_requests():
        for out in pre.step():
            if out.kv_export is not None:
                pre.release_kv_transfer(rid)
                return encode_export(out.kv_export)
    raise AssertionError("no export")


def _run(loop: _EngineLoop) -> None:
    while loop.engine.has_unfinished_requests() or loop.importing or loop.cancelled_imports:
        loop._finish_imports()
        if loop.engine.has_unfinished_requests():
            loop._step()


@pytest.fixture(scope="module")
def engines(text_model):
    base = text_model[0]
    one = _engine(base)
    one.add_request("want", PROMPT, GREEDY)
    want = []
    while one.has_unfinished_requests():
        for out in one.step():
            want = out.outputs[0].token_ids
    return _engine(base), _engine(base), want


def test_steps_go_on_while_an_import_copies_and_its_tokens_are_one_engines(engines, watch) -> None:
    pre, dec, want = engines
    loop, sent, copier = _loop(dec, watch)
    export = _export(pre, "imp")
    used_before = dec.get_stats().kv_blocks_used
    loop._handle(ImportRequest("imp", export))
    assert "imp" in loop.importing and not sent.of("imp")  # held mid-copy: no ack yet
    assert dec.get_stats().kv_blocks_used == used_before + 6  # its blocks are reserved
    # another request runs to its end meanwhile
    dec.add_request("other", [3, 4, 5, 6, 7], GREEDY)
    loop.sent["other"] = 0
    steps = 0
    while dec.has_unfinished_requests():
        loop._step()
        loop._finish_imports()
        steps += 1
    assert steps >= GREEDY.max_tokens and sent.of("other")[-1].finish_reason == "length"
    assert "imp" in loop.importing and not sent.of("imp")
    copier.release()
    _run(loop)
    got = sent.of("imp")
    assert got[0].imported and not got[0].token_ids  # the ack, once the blocks are filled
    tokens = [t for d in got for t in d.token_ids]
    assert [want[0], *tokens] == want  # the first token came from the prefill side
    assert got[-1].finish_reason == "length"
    assert dec.get_stats().kv_blocks_used == 0 and dec.kv.num_requests() == 0


def test_an_abort_mid_copy_frees_the_blocks_once_the_copy_ends(engines, watch) -> None:
    pre, dec, _ = engines
    loop, sent, copier = _loop(dec, watch)
    export = _export(pre, "gone")
    loop._handle(ImportRequest("gone", export))
    assert dec.kv.num_requests() == 1
    loop._handle(AbortRequests(["gone"]))
    assert not loop.importing and len(loop.cancelled_imports) == 1
    loop._finish_imports()
    assert dec.kv.num_requests() == 1  # the copy still writes into them: not freed yet
    copier.release()
    _run(loop)
    assert not sent.of("gone")  # aborted: neither acknowledged nor refused
    assert dec.kv.num_requests() == 0 and not dec.has_unfinished_requests()


def test_a_failed_copy_is_refused_and_frees_the_blocks(engines, watch) -> None:
    pre, dec, _ = engines
    loop, sent, copier = _loop(dec, watch)
    export = _export(pre, "lost")
    loop._handle(ImportRequest("lost", export))
    for _, _, args in copier.held:  # the staged file vanishes before the copy reads it
        unstage(args[1].blocks.path)
    copier.release()
    _run(loop)
    (refusal,) = sent.of("lost")
    assert refusal.finish_reason == "error" and refusal.error_status == 400 and not refusal.imported
    assert dec.kv.num_requests() == 0 and not dec.has_unfinished_requests()


def test_a_second_import_of_an_id_mid_copy_is_refused(engines, watch) -> None:
    pre, dec, _ = engines
    loop, sent, copier = _loop(dec, watch)
    export = _export(pre, "twice")
    loop._handle(ImportRequest("twice", export))
    loop._handle(ImportRequest("twice", export))
    (refusal,) = sent.of("twice")
    assert refusal.error_status == 400 and "already in use" in (refusal.error or "")
    copier.release()
    _run(loop)
    assert sent.of("twice")[1].imported
    assert dec.kv.num_requests() == 0
