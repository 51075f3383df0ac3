"""A Phi-3 model (fused projections, partial rotary) served by a real server: the official `openai`
client's chat completions, rendered with the checkpoint's own chat template, equal HF + PEFT's greedy
tokens for the base model and for a registered adapter on the fused `qkv_proj` / `gate_up_proj`."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.helpers.live_server import start_server
from tests.helpers.served import register
from tests.helpers.tiny_adapters import PHI3_ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer

pytestmark = pytest.mark.slow  # a live server and the PEFT oracle

# Phi-3's own template shape: <|user|>\n…<|end|>\n<|assistant|>\n
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def test_phi3_chat_with_its_template_matches_peft(tmp_path):
    base = build_checkpoint(tmp_path / "model", "phi3", vocab_size=100)
    save_char_tokenizer(base, chat_template=PHI3_TEMPLATE)
    adapter = build_adapter(base, tmp_path / "fused", seed=3, **PHI3_ADAPTER_SPECS["fused-pattern-r16"])
    register(tmp_path / "data", base, "fused", adapter)
    srv = start_server(base, tmp_path / "data")
    try:
        tok, oracle = AutoTokenizer.from_pretrained(base), PeftGreedyOracle(base)
        messages = [{"role": "user", "content": "Hi, who are you?"}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|end|>\n<|assistant|>\n")
        ids = tok.encode(rendered, add_special_tokens=False)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for name, adapter_dir in ((srv.state.settings.served_model_name, None), ("fused", adapter)):
            r = client.chat.completions.create(
                model=name, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            want = tok.decode(oracle.greedy(ids, 8, adapter_dir), skip_special_tokens=True)
            assert r.choices[0].message.content == want, name
            assert r.usage.prompt_tokens == len(ids)
    finally:
        srv.stop()
