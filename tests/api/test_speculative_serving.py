"""`loraplex serve --speculative ngram`: a real server on the demo model answers the official `openai`
client exactly as without speculation (mixed adapters, stop strings, streaming), and `/metrics` carries
the proposed / accepted token counters per adapter."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from api.cli.main import app
from tests.helpers.live_server import start_server, wait_until
from tests.helpers.served import register

pytestmark = pytest.mark.slow  # a live server

DEMO = Path(__file__).resolve().parents[2] / "demo"
WORDS = ["hello world", "abcab abcab", "mississippi"]
EXPECTED = {
    None: lambda t: t,
    "upper": str.upper,
    "reverse": lambda t: t[::-1],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("spec-data")
    for name in ("upper", "reverse"):
        register(data, DEMO / "base", name, DEMO / "adapters" / name)
    srv = start_server(DEMO / "base", data, speculative="ngram", num_speculative_tokens=4)
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_mixed_adapters_stop_strings_and_metrics(server):
    c = _client(server)
    served = c.models.list().data[0].id
    for adapter, fn in EXPECTED.items():
        for words in WORDS:
            out = c.completions.create(
                model=adapter or served, prompt=f"{words}=", max_tokens=32, temperature=0, stop=["\n"]
            )
            assert out.choices[0].text == fn(words), (adapter, words)
            assert out.choices[0].finish_reason == "stop"
    # a stop string inside a run of accepted proposals, streamed
    chunks = c.completions.create(
        model=served, prompt="hello world=", max_tokens=32, temperature=0, stop=["wor"], stream=True
    )
    assert "".join(ch.choices[0].text for ch in chunks) == "hello "
    out = c.completions.create(model=served, prompt="hello world=", max_tokens=3, temperature=0)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("hel", "length")

    def spec_metrics() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = re.findall(r'^(loraplex_spec_\w+)\{adapter="([^"]*)"\} (\S+)$', text, re.M)
        return {f"{name}/{adapter}": float(v) for name, adapter, v in found}

    assert wait_until(lambda: spec_metrics().get("loraplex_spec_accepted_tokens_total/", 0) > 0)
    m = spec_metrics()
    # which adapters speculate depends on their acceptance and this machine's timings (adaptive k); the
    # base model's echo is accepted almost always, so it always does
    labels = {key.split("/", 1)[1] for key in m}
    assert "" in labels and labels <= {"", "upper", "reverse"}
    for adapter in labels:
        proposed = m[f"loraplex_spec_proposed_tokens_total/{adapter}"]
        assert proposed > 0 and m[f"loraplex_spec_accepted_tokens_total/{adapter}"] <= proposed
    assert m["loraplex_spec_mean_acceptance_length/"] > 1.5


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--speculative", "medusa"), "speculative must be 'ngram' or 'draft:PATH'"),
        (("--speculative", "ngram", "--num-speculative-tokens", "0"), "num_speculative_tokens must be in"),
    ],
)
def test_serve_refuses_bad_speculative_options(tmp_path, option, message):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "1", *option], env=env)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_serve_passes_speculative_options_to_the_engine(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr("api.server.serve", lambda settings, **_: started.append(settings))
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MODEL": str(DEMO / "base")}
    args = ["serve", "--port", "0", "--speculative", "ngram", "--num-speculative-tokens", "3"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert [(s.engine.speculative, s.engine.num_speculative_tokens) for s in started] == [("ngram", 3)]
