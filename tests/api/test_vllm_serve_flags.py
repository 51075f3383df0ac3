"""`loraplex serve` started the way `vllm serve` is (issue 32): the positional model and vLLM's flags start
the server and mean what they mean in vLLM; `/metrics` carries vLLM's request families.

One server, started once with many vLLM flags, answers the openai client; the refusals (flags that cannot
mean what vLLM means) fail before any model loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from api.cli import app
from tests.helpers.live_server import ADMIN_TOKEN, free_port, wait_until

pytestmark = pytest.mark.slow  # a live server

DEMO = Path(__file__).resolve().parents[2] / "demo"
STATIC_KEY = "sk-static-vllm-style-key"
MAX_LEN = 40  # the demo model has 64 positions
# A template of our own: BOS, each message's content, then "=" (the demo adapters' prompt form).
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}="


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`loraplex serve demo/base` with vLLM's flags, as a migrating user types them; its URL."""
    root = tmp_path_factory.mktemp("vllm-flags")
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "VLLM_"))}
    env |= {"LORAPLEX_DATA_DIR": str(root / "data"), "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}
    env["LORAPLEX_DOCS_ACCESS"] = "api_key"  # /docs for API keys: the static one is one
    reverse = json.dumps({"name": "rev", "path": str(DEMO / "adapters" / "reverse")})
    cmd = [str(Path(sys.executable).parent / "loraplex"), "serve", str(DEMO / "base")]
    cmd += ["--port", str(port), "--device", "cpu", "--num-kv-blocks", "64", "--log-level", "warning"]
    cmd += ["--lora-modules", f"upper={DEMO / 'adapters' / 'upper'}", reverse]  # vLLM's variadic form
    cmd += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4"]
    cmd += ["--api-key", STATIC_KEY, "--served-model-name", "demo", "--max-model-len", str(MAX_LEN)]
    cmd += ["--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--chat-template", str(template)]
    cmd += ["--tokenizer", str(DEMO / "base"), "--seed", "1", "--max-num-batched-tokens", "256"]
    cmd += ["--max-num-seqs", "8", "--enable-auto-tool-choice", "--tool-call-parser", "json"]
    cmd += ["--threads", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until(lambda: _healthy(url) or proc.poll() is not None, timeout=180) or proc.poll():
            proc.kill()
            pytest.fail(f"server did not start:\n{proc.stdout.read() if proc.stdout else ''}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _client(url: str, key: str = STATIC_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_lora_modules_are_served_under_their_names(server: str) -> None:
    client = _client(server)
    ids = {m.id for m in client.models.list().data}
    assert {"demo", "upper", "rev"} <= ids, ids
    for model, expected in (("upper", "HELLO WORLD"), ("rev", "dlrow olleh"), ("demo", "hello world")):
        out = client.completions.create(model=model, prompt="hello world=", max_tokens=20, temperature=0)
        assert out.choices[0].text.strip() == expected, (model, out.choices[0].text)


def test_api_key_is_required_and_checked(server: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(server, "sk-wrong").completions.create(model="demo", prompt="hi=", max_tokens=2)
    anon = httpx.post(f"{server}/v1/completions", json={"model": "demo", "prompt": "hi=", "max_tokens": 2})
    assert anon.status_code == 401 and "API key required" in anon.json()["error"]["message"]
    docs = f"{server}/openapi.json"
    assert httpx.get(docs, headers={"Authorization": f"Bearer {STATIC_KEY}"}).status_code == 200
    assert httpx.get(docs, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401


def test_max_model_len_caps_the_context(server: str) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match=f"context is {MAX_LEN} tokens"):
        client.completions.create(model="demo", prompt="ab " * 20 + "=", max_tokens=2)  # 61 < 64 positions
    out = client.completions.create(model="demo", prompt="abc=", temperature=0)  # no max_tokens: to the cap
    assert out.usage is not None and out.usage.prompt_tokens + out.usage.completion_tokens <= MAX_LEN


def test_chat_template_file_replaces_the_models(server: str) -> None:
    out = _client(server).chat.completions.create(
        model="upper", messages=[{"role": "user", "content": "hello world"}], max_tokens=20, temperature=0
    )
    # The demo model answers only its "<text>=" form, which only our template produces.
    assert (out.choices[0].message.content or "").strip() == "HELLO WORLD"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len("<s>hello world=") - 2  # a character tokenizer; <s> is one


def test_vllm_metric_families_parse_and_carry_model_name(server: str) -> None:
    client = _client(server)
    client.completions.create(model="upper", prompt="abc=", max_tokens=30, temperature=0)  # stops
    client.completions.create(model="demo", prompt="abc=", max_tokens=1, temperature=0)  # length
    for _ in range(2):  # two full KV blocks, twice: a prefix cache would be asked (and hit)
        client.completions.create(model="demo", prompt="abcdefgh " * 4 + "=", max_tokens=1)
    families: dict = {}

    def scrape() -> bool:  # until the engine's stats (sent twice a second) include those requests
        text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text
        families.update({f.name: f for f in text_string_to_metric_families(text)})
        prompts = next(x.value for x in families["vllm:prompt_tokens"].samples if x.name.endswith("_total"))
        return families["vllm:prefix_cache_queries"].samples[0].value >= prompts  # every prompt looked up

    assert wait_until(scrape, timeout=10)
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        family = families[name]
        assert family.type == "histogram", name
        count = next(s for s in family.samples if s.name == f"{name}_count")
        assert count.labels == {"model_name": "demo"} and count.value >= 1, (name, count)
        buckets = [s for s in family.samples if s.name == f"{name}_bucket"]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count.value
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens"):
        (sample,) = [s for s in families[name].samples if s.name == f"{name}_total"]
        assert families[name].type == "counter" and sample.labels == {"model_name": "demo"}
        assert sample.value >= 2
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert reasons.get("stop", 0) >= 1 and reasons.get("length", 0) >= 1, reasons
    for name in ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        (sample,) = [s for s in families[name].samples if s.name == f"{name}_total"]
        assert sample.labels == {"model_name": "demo"}, name
    totals = {name: families[name].samples[0].value for name in families if name.startswith("vllm:prefix")}
    # Looked up, never hit: --no-enable-prefix-caching (with it, the repeated prompt hits its 2 blocks)
    assert totals["vllm:prefix_cache_queries"] >= 2 * 38 and totals["vllm:prefix_cache_hits"] == 0, totals
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert [s.labels for s in families[name].samples] == [{"model_name": "demo"}]
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels["model_name"] == "demo" and info.labels["max_lora"] == "2"


def _serve(*args: str, tmp_path: Path) -> tuple[int, str]:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}
    port = str(free_port())
    result = CliRunner().invoke(app, ["serve", *args, "--port", port, "--device", "cpu"], env=env)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tool-call-parser", "hermes"], "--tool-call-parser hermes: not supported"),
        (["--lora-modules", "justaname"], "expected name=path"),
        (["--lora-modules", '{"name": "x"}'], "expected name=path"),
        (["--lora-modules", "a=/x", "a=/y"], "names a more than once"),
        (["--max-model-len", "65"], "max_model_len must be in [2, 64]"),
        (["--chat-template", "/no/such/template"], "no such file, and not a Jinja template"),
        (["--lora-modules", "ghost=/no/such/adapter"], "--lora-modules ghost=/no/such/adapter:"),
        (["--tokenizer", "/no/such/tokenizer"], "--tokenizer /no/such/tokenizer: no tokenizer files"),
        (["--tokenizer", str(DEMO / "adapters")], "no tokenizer files there"),
        (["--gpu-memory-utilization", "0"], "gpu_memory_utilization must be in (0, 1]"),
        (["-tp", "3"], "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
        (["--tensor-parallel-size", "2", "--threads", "1"], "more ranks than the 1 CPUs"),
        # accepted: the start gets past it to the next check
        (["-tp", "2", "--fully-sharded-loras", "--threads", "1"], "more ranks than the 1 CPUs"),
        (["-tp", "2", "--enable-expert-parallel", "--threads", "1"], "more ranks than the 1 CPUs"),
        (["-tp", "2", "--expert-placement", "striped"], "--expert-placement must be linear or round_robin"),
    ],
)
def test_flags_that_cannot_mean_what_vllm_means_are_refused(args, message, tmp_path) -> None:
    code, out = _serve(str(DEMO / "base"), *args, tmp_path=tmp_path)
    assert code == 1 and message in " ".join(out.split()), out
    assert "Traceback" not in out


def test_chat_template_without_a_tokenizer_is_refused(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((DEMO / "base" / "config.json").read_text())
    code, out = _serve(str(model), "--chat-template", TEMPLATE, tmp_path=tmp_path)
    assert code == 1 and "--chat-template needs a tokenizer" in out, out


def test_unknown_flags_and_two_models_are_errors(tmp_path) -> None:
    code, out = _serve(str(DEMO / "base"), "--pipeline-parallel-size", "2", tmp_path=tmp_path)
    assert code == 2 and "No such option" in out, out
    code, out = _serve(str(DEMO / "base"), "--model", str(DEMO / "adapters"), tmp_path=tmp_path)
    assert code == 1 and "two base models" in out, out
