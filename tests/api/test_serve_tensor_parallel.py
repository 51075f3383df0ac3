"""A real server with `tensor_parallel_size=2` (gloo, two ranks on the CPU), driven by the openai client.

Its greedy answers for the base model and each adapter equal HF + PEFT's (as the TP=1 server's do,
tests/api/test_server_openai.py), and so do a weighted mix's (the `adapters` extension); structured
output and n > 1 work as at TP=1. kill -9 of the worker
rank mid-stream ends the stream with the retryable SSE error within seconds, `/health` says unhealthy
until the engine and its group are back, and the answers afterwards are right again.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import SERVED_ADAPTERS
from tests.helpers.live_server import wait_until
from tests.helpers.peft_batch import build_weighted_cat
from tests.helpers.served import serve_text_model

pytestmark = pytest.mark.slow  # a live server

PROMPT = "hello world"


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    srv = serve_text_model(text_model, tmp_path_factory.mktemp("data"), tensor_parallel_size=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(text_model):
    return AutoTokenizer.from_pretrained(text_model[0])


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def check_answers(server, text_model, tok) -> None:
    """The base model and every served adapter answer PEFT's greedy tokens."""
    _, adapters, oracle = text_model
    for adapter in (None, *SERVED_ADAPTERS):
        model = adapter or server.state.settings.served_model_name
        r = client(server).completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        ids = oracle.greedy(tok.encode(PROMPT), 8, adapters[adapter] if adapter else None)
        assert r.choices[0].text == tok.decode(ids), adapter


def worker_pids(engine_pid: int) -> list[int]:
    """The tensor-parallel workers (`python -m engine.distributed`) the engine process started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == engine_pid and b"engine.distributed" in cmd:
            pids.append(int(entry.name))
    return pids


def test_answers_equal_peft(server, text_model, tok):
    check_answers(server, text_model, tok)


def test_weighted_mix_under_tp_equals_peft_cat(server, text_model, tok, tmp_path):
    """The `adapters` extension (a weighted mix of two served adapters of ranks 4 and 8) under TP=2:
    PEFT's `add_weighted_adapter(cat)` tokens."""
    base, adapters, oracle = text_model
    a, b = SERVED_ADAPTERS[:2]
    cat = build_weighted_cat(base, adapters, [(a, 0.7), (b, -0.3)], tmp_path / "cat")
    r = client(server).completions.create(
        model=server.state.settings.served_model_name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "adapters": [{"name": a, "weight": 0.7}, {"name": b, "weight": -0.3}],
        },
    )
    want = oracle.greedy(tok.encode(PROMPT), 8, cat)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)  # as the server detokenizes


def test_structured_output_and_n2_under_tp(server):
    """Grammar masks and `n > 1` are rank 0's business: a regex-constrained sampled completion with n=2
    under TP=2 matches its grammar in both choices."""
    r = client(server).completions.create(
        model=server.state.settings.served_model_name,
        prompt=PROMPT,
        max_tokens=30,
        temperature=1.0,
        seed=3,
        n=2,
        extra_body={"guided_regex": "(yes|no), [0-9]{2,4}!"},
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert re.fullmatch(r"(yes|no), [0-9]{2,4}!", choice.text), choice.text


def test_worker_killed_mid_stream_ends_it_and_recovers(server, text_model, tok):
    engine_pid = server.state.client.pid
    (worker,) = worker_pids(engine_pid)
    stream = client(server).completions.create(
        model=server.state.settings.served_model_name,
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in chunks:
            pass
    assert time.monotonic() - killed < 30
    assert "retry" in str(err.value.message)
    assert wait_until(lambda: _status(server.url) == 200, timeout=120), "/health did not come back"
    assert server.state.client.pid != engine_pid and server.state.client.restarts >= 1
    assert len(worker_pids(server.state.client.pid)) == 1
    check_answers(server, text_model, tok)


def _status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0
