"""vLLM's and OpenAI's sampling fields through a real server and the official `openai` client: penalties,
logit_bias, min_tokens, bad words against HF's logits processors (concurrent requests on different
adapters, so they share batches); best_of; guided_* / structured_outputs; return_token_ids; suffix and
fields loraplex does not implement refused with a 400 naming them."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.helpers.hf_logits_reference import reference_decode
from tests.helpers.served import serve_text_model

pytestmark = pytest.mark.slow  # a live server


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    srv = serve_text_model(text_model, tmp_path_factory.mktemp("data"))
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


# Each: (adapter, standard kwargs, vLLM extras); all greedy, ignore_eos, 10 tokens.
CASES = [
    (None, {"frequency_penalty": 1.2, "presence_penalty": 0.4}, {}),
    ("all7-r4", {}, {"repetition_penalty": 1.6}),
    ("qv-r8-rslora", {"logit_bias": {"5": -100, "40": 4}}, {"min_tokens": 6, "stop_token_ids": [47]}),
    ("gud-r12", {"presence_penalty": -1.0}, {"repetition_penalty": 0.8, "bad_words": ["l", "o w"]}),
    ("all7-r4", {}, {}),
]


def _reference(text_model, tokenizer, prompt_ids, adapter, kwargs, extra) -> list[int]:
    _, adapters, oracle = text_model
    bad = [s for w in extra.get("bad_words", []) for s in _bad_word_ids(tokenizer, w)]
    p = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        frequency_penalty=kwargs.get("frequency_penalty", 0.0),
        presence_penalty=kwargs.get("presence_penalty", 0.0),
        repetition_penalty=extra.get("repetition_penalty", 1.0),
        logit_bias={int(k): float(v) for k, v in kwargs.get("logit_bias", {}).items()} or None,
        min_tokens=extra.get("min_tokens", 0),
        stop_token_ids=extra.get("stop_token_ids", []),
        bad_words_token_ids=bad,
    )
    return reference_decode(oracle, adapters[adapter] if adapter else None, prompt_ids, p, ())


def _bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    bare = tokenizer.encode(word, add_special_tokens=False)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    return [bare] + ([spaced] if spaced != bare else [])


def test_penalties_in_concurrent_mixed_adapter_requests_match_hf(server, text_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model[0])
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = server.state.settings.served_model_name

    async def one(adapter, kwargs, extra):
        return await c.completions.create(
            model=adapter or model,
            prompt="hello world hello",
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True} | extra,
            **kwargs,
        )

    async def run():
        return await asyncio.gather(*(one(*case) for case in CASES * 2))

    outs = asyncio.run(run())
    for (adapter, kwargs, extra), r in zip(CASES * 2, outs, strict=True):
        choice = r.choices[0].model_dump()
        want = _reference(text_model, tokenizer, choice["prompt_token_ids"], adapter, kwargs, extra)
        assert choice["token_ids"] == want, f"{adapter} {kwargs} {extra}"
    plain = outs[4].choices[0].model_dump()["token_ids"]
    assert outs[1].choices[0].model_dump()["token_ids"] != plain  # the penalty changed the text


def test_chat_penalty_and_return_token_ids(server, text_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model[0])
    r = _client(server).chat.completions.create(
        model="all7-r4",
        messages=[{"role": "user", "content": "abc abc"}],
        max_tokens=10,
        temperature=0,
        frequency_penalty=1.5,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    body = r.model_dump()
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == 10 and body["prompt_token_ids"]
    want = _reference(
        text_model, tokenizer, body["prompt_token_ids"], "all7-r4", {"frequency_penalty": 1.5}, {}
    )
    assert ids == want
    assert tokenizer.decode(ids) == body["choices"][0]["message"]["content"]
    stream = _client(server).chat.completions.create(
        model="all7-r4",
        messages=[{"role": "user", "content": "abc abc"}],
        max_tokens=10,
        temperature=0,
        frequency_penalty=1.5,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]  # top level, as vLLM
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == ids


def test_best_of_returns_the_best_candidates(server):
    common = {"model": "all7-r4", "prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = _post(server, "/v1/completions", common | {"n": 3, "logprobs": 0, "ignore_eos": True}).json()
    best = _post(server, "/v1/completions", common | {"n": 1, "best_of": 3, "ignore_eos": True}).json()
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]}
    assert best["choices"][0]["text"] == max(score, key=score.__getitem__)
    assert best["choices"][0]["logprobs"] is None  # not asked for
    assert best["usage"]["completion_tokens"] == 18  # every candidate's tokens are billed
    r = _post(server, "/v1/completions", common | {"n": 2, "best_of": 3, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = _post(server, "/v1/completions", common | {"n": 3, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_guided_fields_map_onto_structured_output(server):
    c = _client(server)
    r = c.completions.create(
        model="all7-r4", prompt="pick", max_tokens=12, extra_body={"guided_choice": ["yes", "no (never)"]}
    )
    assert r.choices[0].text in ("yes", "no (never)")
    r = c.completions.create(
        model="all7-r4", prompt="num", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}-x"}
    )
    assert re.fullmatch(r"[0-9]{3}-x", r.choices[0].text)
    for grammar in ('root ::= "yes" | "no" | answer\nanswer ::= [0-9]+', 'start: "yes" | "no" | /[0-9]+/'):
        r = c.completions.create(
            model="all7-r4", prompt="g", max_tokens=8, extra_body={"guided_grammar": grammar}
        )
        assert re.fullmatch(r"yes|no|[0-9]+", r.choices[0].text), grammar  # GBNF (vLLM's EBNF), Lark
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = c.chat.completions.create(
        model="gud-r12",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=200,
        extra_body={"structured_outputs": {"json": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["a"], int)
    r = c.completions.create(
        model="all7-r4", prompt="j", max_tokens=200, extra_body={"guided_json": json.dumps(schema)}
    )
    assert isinstance(json.loads(r.choices[0].text)["a"], int)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"suffix": "def f():"}, "suffix"),
        ({"frobnicate": 3}, "frobnicate"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"logit_bias": {"100": 1}}, "logit_bias"),  # the vocabulary is 100 tokens
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 150}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
        ({"bad_words": [""]}, "bad_words.0"),
        ({"bad_words": ["ok", "a" * 200]}, "bad_words"),  # more tokens than a banned sequence may have
    ],
)
def test_unsupported_or_out_of_range_is_a_400_naming_the_field(server, extra, param):
    body = {"model": "all7-r4", "prompt": "hi", "max_tokens": 4} | extra
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"]
    with pytest.raises(openai.BadRequestError):
        _client(server).completions.create(model="all7-r4", prompt="hi", max_tokens=4, extra_body=extra)


def test_unknown_chat_field_is_refused_and_tolerated_ones_accepted(server):
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(
        server, "/v1/chat/completions", {"model": "all7-r4", "messages": msgs, "reasoning_effort": "low"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    ok = {
        "user": "u1",
        "store": False,
        "metadata": {"k": "v"},
        "skip_special_tokens": True,
        "use_beam_search": False,
        "stream_options": None,
        "some_future_field": None,  # null = not set
    }
    r = _post(server, "/v1/chat/completions", {"model": "all7-r4", "messages": msgs, "max_tokens": 3} | ok)
    assert r.status_code == 200, r.text
