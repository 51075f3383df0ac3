"""Deactivating and activating an adapter while its requests are queued, on a real server.

Semantics: a request the engine admitted before the deactivation finishes on the version it was admitted
with; a later one gets 404. So every probe either succeeds with the adapter's exact answer or gets 404,
never a 500; an innocent workload on another adapter is untouched; and once the adapter stays
deactivated the engine forgets it (nothing stays cached, pinned or holding KV blocks).
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from tests.helpers.live_server import wait_until
from tests.helpers.served import serve_text_model

pytestmark = pytest.mark.slow  # a live server

RACED, INNOCENT = "gud-r12", "all7-r4"
PROBES = 500
MAX_TOKENS = 3
LONG_TOKENS = 40


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    # A small running batch, so that many requests wait in the engine's queue.
    srv = serve_text_model(text_model, tmp_path_factory.mktemp("data"), max_num_seqs=4)
    yield srv
    srv.stop()


def _expected(text_model, adapter: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    base, adapters, oracle = text_model
    tok = AutoTokenizer.from_pretrained(base)
    return tok.decode(oracle.greedy(tok.encode(prompt), max_tokens, adapters[adapter]))


def _complete(client: openai.OpenAI, adapter: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    r = client.completions.create(
        model=adapter, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def test_deactivate_activate_race_gives_only_answers_or_404(server, text_model):
    prompt = "race"
    want = {a: _expected(text_model, a, prompt) for a in (RACED, INNOCENT)}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    admin = server.admin()
    stop = threading.Event()
    toggles = {"n": 0}

    def toggle() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            for op in ("deactivate", "activate"):
                r = admin.post(f"/admin/api/adapters/{RACED}/{op}")
                assert r.status_code == 200, r.text
                toggles["n"] += 1
                stop.wait(rng.uniform(0, 0.03))

    outcomes: list[str] = []
    errors: list[str] = []

    def probe(i: int) -> None:
        adapter = RACED if i % 5 else INNOCENT
        try:
            text = _complete(client, adapter, prompt)
        except openai.NotFoundError as exc:
            if adapter == INNOCENT:
                errors.append(f"innocent request got 404: {exc}")
            else:
                assert exc.body["code"] == "model_not_found"  # type: ignore[index]
                outcomes.append("404")
            return
        except openai.APIError as exc:  # a 500 (or anything else) is the bug this test guards against
            errors.append(f"{adapter}: {exc!r}")
            return
        if text != want[adapter]:
            errors.append(f"{adapter}: {text!r} != {want[adapter]!r}")
        outcomes.append(f"ok-{adapter}")

    toggler = threading.Thread(target=toggle, daemon=True)
    toggler.start()
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(probe, range(PROBES)))
    finally:
        stop.set()
        toggler.join(timeout=60)
    assert errors == []
    assert len(outcomes) == PROBES
    assert outcomes.count(f"ok-{RACED}") > 0 and outcomes.count("404") > 0, outcomes  # the race happened
    assert toggles["n"] > 10

    # Deactivated while its requests run and wait: they finish on it, then the engine forgets it.
    long_want = _expected(text_model, RACED, "long", LONG_TOKENS)
    digest = next(a["current"]["digest"] for a in admin.get("/admin/api/adapters").json()["data"]
                  if a["name"] == RACED)  # fmt: skip
    stream_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(_complete, client, RACED, "long", LONG_TOKENS) for _ in range(12)]
        stream = stream_client.completions.create(
            model=RACED, prompt="long", max_tokens=LONG_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed = []
        for chunk in stream:
            if not streamed:  # this request is running in the engine now
                assert admin.post(f"/admin/api/adapters/{RACED}/deactivate").status_code == 200
            streamed.append(chunk.choices[0].text if chunk.choices else "")
        assert "".join(streamed) == long_want
        assert [f.result() for f in futures] == [long_want] * 12

    def forgotten() -> bool:
        pool = admin.get("/admin/api/pool").json()
        eng = pool["engine"]
        return digest not in {a["digest"] for a in pool["adapters"]} and eng["kv_blocks_used"] == 0

    assert wait_until(forgotten, timeout=30), admin.get("/admin/api/pool").json()
    assert not any(a["pinned"] for a in admin.get("/admin/api/pool").json()["adapters"])
    assert admin.post(f"/admin/api/adapters/{RACED}/activate").status_code == 200
    assert wait_until(lambda: _completes(client, prompt) == want[RACED], timeout=30)


def _completes(client: openai.OpenAI, prompt: str) -> str | None:
    try:
        return _complete(client, RACED, prompt)
    except openai.NotFoundError:  # the server has not seen the activation yet
        return None
