"""`loraplex serve` on a GGUF file: a real server answers chat and completions with the tokenizer and
chat template from the file's metadata, and its greedy tokens are transformers' on the same file."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gguf_files import build_gguf_pair, hf_gguf_model
from tests.helpers.live_server import start_server

pytestmark = pytest.mark.slow  # a real server and the HF oracle


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def test_serve_a_gguf_file(tmp_path):
    from transformers import AutoTokenizer

    _, gguf = build_gguf_pair(tmp_path / "m", "llama", "Q8_0")
    srv = start_server(gguf, tmp_path / "data")
    try:
        client = srv.admin()
        models = client.get("/v1/models").json()
        assert gguf.name in [m["id"] for m in models["data"]]
        assert srv.state.settings.model_aliases == (gguf.stem,)  # "tiny-Q8_0" means the base model too
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        oracle = hf_gguf_model(gguf)
        body = {"model": gguf.name, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body | {"prompt": "Hello there"})
        assert r.status_code == 200, r.text
        ids = tok.encode("Hello there")
        assert r.json()["choices"][0]["text"] == tok.decode(
            _hf_greedy(oracle, ids, 6), skip_special_tokens=True
        )
        messages = [{"role": "user", "content": "Hi"}]
        r = client.post("/v1/chat/completions", json=body | {"messages": messages, "model": gguf.stem})
        assert r.status_code == 200, r.text
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("assistant: ")  # the file's own template
        chat_ids = tok.encode(rendered, add_special_tokens=False)
        want = tok.decode(_hf_greedy(oracle, chat_ids, 6), skip_special_tokens=True)
        assert r.json()["choices"][0]["message"]["content"] == want
    finally:
        srv.stop()
