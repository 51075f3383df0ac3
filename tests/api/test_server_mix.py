"""Weighted adapter mixes through a real server (the `adapters` extension), driven by the official
`openai` client: completions, chat and a per-adapter URL equal PEFT's `add_weighted_adapter(cat)`; the
validation errors (unknown, inactive or out-of-scope members, bad weights, duplicates, too many, a
`model` adapter outside the mix, DoRA members); every member's rate limit applies; usage names the mix."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from api.chat_template import render_chat
from lora_registry import RegistrySettings, open_registry
from lora_registry.events import InProcessBus
from tests.helpers.live_server import start_server
from tests.helpers.peft_batch import build_weighted_cat
from tests.helpers.served import SERVED_ADAPTERS, register
from tests.helpers.tiny_adapters import build_adapter

pytestmark = pytest.mark.slow  # a live server

A, B, C = SERVED_ADAPTERS  # all7-r4, qv-r8-rslora, gud-r12
MIX = [{"name": A, "weight": 0.7}, {"name": B, "weight": 0.3}]


@pytest.fixture(scope="module")
def served(text_model, tmp_path_factory):
    """A server (API keys required, max_loras=2, a small adapter pool) with the three served adapters,
    a DoRA adapter, an inactive one and a copy of C; a rate limit of 1 request/minute on C.
    Yields (server, keys, PEFT cat dir of MIX)."""
    base, adapters, _ = text_model
    root = tmp_path_factory.mktemp("mix")
    data = root / "data"
    for name in SERVED_ADAPTERS:
        register(data, base, name, adapters[name])
    dora = build_adapter(
        base, root / "dora", seed=5, r=4, lora_alpha=8, target_modules="all-linear", use_dora=True
    )
    register(data, base, "dora-bot", dora)
    register(data, base, "sleeping", adapters[C], activate=False)
    register(data, base, "gud-copy", adapters[C])  # C without its rate limit
    env = {"LORAPLEX_DATA_DIR": str(data), "LORAPLEX_MODEL": str(base)}
    reg = open_registry(RegistrySettings.from_env(env), bus=InProcessBus())
    try:
        keys = {
            "all": reg.keys.create("all", admin=True).secret,
            "scoped": reg.keys.create("scoped", adapters=[A]).secret,
        }
        reg.limits.set("adapter", C, requests_per_minute=1)
    finally:
        reg.close()
    cat = build_weighted_cat(base, adapters, [(A, 0.7), (B, 0.3)], root / "cat")
    # a small adapter pool (3 pages per projection of rank 4): A+B and B+C fit at once, A+C (gate_proj:
    # 1 + 3 pages) never does
    server = start_server(
        base,
        data,
        settings_overrides={"require_api_key": True},
        max_loras=2,
        max_lora_rank=12,
        lora_page_rank=4,
        lora_pool_pages=3,
    )
    yield server, keys, cat
    server.stop()


def client(server, key: str, adapter: str | None = None) -> openai.OpenAI:
    base = f"{server.url}/v1" if adapter is None else f"{server.url}/v1/adapters/{adapter}"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(text_model):
    return AutoTokenizer.from_pretrained(text_model[0])


def test_completion_with_a_mix_equals_peft_cat(served, text_model, tok):
    server, keys, cat = served
    _, _, oracle = text_model
    r = client(server, keys["all"]).completions.create(
        model=server.state.settings.served_model_name,
        prompt="hello world",
        max_tokens=8,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "adapters": MIX},
    )
    ids = tok.encode("hello world")
    want = oracle.greedy(ids, 8, cat)
    assert r.choices[0].text == tok.decode(want)
    assert r.model == server.state.settings.served_model_name
    ref = torch.log_softmax(oracle.logits(ids + want, cat), -1)
    for i, (tok_id, lp) in enumerate(zip(want, r.choices[0].logprobs.token_logprobs, strict=True)):
        assert lp == pytest.approx(float(ref[len(ids) - 1 + i, tok_id]), abs=1e-4)


def test_chat_and_per_adapter_url_with_a_mix(served, text_model, tok):
    """The mix through chat (model = a member) and through the URL of a member; both equal PEFT's cat,
    and equal each other (the same mix, whatever names it)."""
    server, keys, cat = served
    msgs = [{"role": "user", "content": "abc"}]
    kw = dict(messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "adapters": MIX})
    by_model = client(server, keys["all"]).chat.completions.create(model=A, **kw)
    by_url = client(server, keys["all"], adapter=B).chat.completions.create(model="ignored", **kw)
    assert by_model.model == A and by_url.model == B
    assert by_model.choices[0].message.content == by_url.choices[0].message.content
    ids = tok.encode(render_chat(tok, msgs, None), add_special_tokens=False)  # the server's template
    _, _, oracle = text_model
    assert by_url.choices[0].message.content == tok.decode(oracle.greedy(list(ids), 6, cat))


def test_responses_with_a_mix_equals_peft_cat(served, text_model, tok):
    """`/v1/responses` takes `adapters` as chat does (the official client's `extra_body`)."""
    server, keys, cat = served
    _, _, oracle = text_model
    r = client(server, keys["all"]).responses.create(
        model=A, input="abc", max_output_tokens=6, temperature=0, extra_body={"adapters": MIX}
    )
    assert r.model == A
    msgs = [{"role": "user", "content": "abc"}]
    ids = tok.encode(render_chat(tok, msgs, None), add_special_tokens=False)
    want = oracle.greedy(list(ids), 6, cat)
    if tok.eos_token_id in want:
        want = want[: want.index(tok.eos_token_id)]
    assert r.output_text == tok.decode(want, skip_special_tokens=True)
    base = client(server, keys["all"]).responses.create(
        model=A, input="abc", max_output_tokens=6, temperature=0
    )
    assert base.output_text != r.output_text  # the mix, not A alone, answered


def test_responses_refuse_a_bad_mix_naming_the_field(served):
    server, keys, _ = served
    for mix, words in (
        ([{"name": A, "weight": 0.5}, {"name": A, "weight": 0.5}], "appears twice"),
        ([{"name": "nope", "weight": 1.0}], "'nope' does not exist"),
    ):
        body = {"input": "hi", "max_output_tokens": 2, "adapters": mix}
        r = _post(server, keys["all"], body, path="/v1/responses")
        assert r.status_code in (400, 404), r.text
        assert words in r.json()["error"]["message"] and r.json()["error"]["param"].startswith("adapters")


def _post(server, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    if path.endswith("/completions") and "chat" not in path:
        body = {"prompt": "hi", "max_tokens": 2} | body
    return httpx.post(
        f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


@pytest.mark.parametrize(
    ("adapters", "status", "words"),
    [
        (
            [{"name": "nope", "weight": 1.0}],
            404,
            "adapters: the adapter 'nope' does not exist or is not active",
        ),
        ([{"name": "sleeping", "weight": 1.0}], 404, "'sleeping' does not exist or is not active"),
        ([{"name": A, "weight": 0}], 400, "must be non-zero"),
        ([{"name": A, "weight": 1e9}], 400, "less than or equal to 100"),
        ([{"name": A, "weight": 0.5}, {"name": A, "weight": 0.5}], 400, f"adapter '{A}' appears twice"),
        ([{"name": A, "weight": 1, "scale": 2}], 400, "Extra inputs are not permitted"),
        ([], 400, "at least 1 item"),
        ([{"name": n, "weight": 1.0} for n in (A, B, C)], 400, "at most 2 per request"),
        ([{"name": A, "weight": 0.5}, {"name": "dora-bot", "weight": 0.5}], 400, "'dora-bot' uses DoRA"),
    ],
)
def test_bad_mixes_are_refused(served, adapters, status, words):
    server, keys, _ = served
    r = _post(server, keys["all"], {"adapters": adapters})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"].startswith("adapters")


def test_model_and_url_must_name_a_member(served):
    server, keys, _ = served
    r = _post(server, keys["all"], {"model": C, "adapters": MIX})
    assert r.status_code == 400 and f"names the adapter '{C}', which is not in adapters" in r.text
    r = _post(server, keys["all"], {"adapters": MIX}, path=f"/v1/adapters/{C}/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapters"
    assert _post(server, keys["all"], {"model": "no-such-adapter", "adapters": MIX}).status_code == 400


def test_a_scoped_key_must_be_allowed_every_member(served):
    server, keys, _ = served
    r = _post(server, keys["scoped"], {"adapters": MIX})
    assert r.status_code == 404 and f"'{B}' does not exist, is not active, or this API key may not" in r.text
    assert _post(server, keys["scoped"], {"adapters": [{"name": A, "weight": 0.5}]}).status_code == 200


def test_every_member_rate_limit_applies_and_usage_names_the_mix(served):
    server, keys, _ = served
    mix = [{"name": B, "weight": 0.5}, {"name": C, "weight": 0.5}]
    assert _post(server, keys["all"], {"adapters": mix}).status_code == 200
    r = _post(server, keys["all"], {"adapters": mix})
    assert r.status_code == 429 and f"adapter '{C}'" in r.json()["error"]["message"]
    assert _post(server, keys["all"], {"adapters": MIX}).status_code == 200  # C not in it: not limited
    assert server.state.usage.recorder.flush()
    with server.admin() as admin:
        rows = admin.get("/admin/api/usage", params={"by": "adapter"}).json()["rows"]
    names = {row["name"] for row in rows}
    assert {f"{B}*0.5+{C}*0.5", f"{A}*0.7+{B}*0.3"} <= names


def test_a_mix_the_pool_cannot_hold_at_once_is_a_400(served):
    """A+C (here C's copy without a rate limit) needs 4 pages of gate_proj at once, the pool has 3:
    refused (whether the members are loaded yet or not), never left waiting; the server goes on serving."""
    server, keys, _ = served
    mix = [{"name": A, "weight": 0.5}, {"name": "gud-copy", "weight": 0.5}]
    for _ in range(2):  # first with C not loaded yet (refused once it is), then with both known
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "adapters": mix}
        r = _post(server, keys["all"], body, path="/v1/chat/completions")
        assert r.status_code == 400, r.text
        assert (
            "the weighted mix needs 4 adapter pool pages of gate_proj at once" in r.json()["error"]["message"]
        )
    assert _post(server, keys["all"], {"adapters": MIX}).status_code == 200
