"""The online peer benchmark's pure parts: one planned workload for both servers, the client's requests
and counting, the headline maths, vLLM's command line (no vLLM and no server needed)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from bench.common.plots import plot_online_peer
from bench.peer.online import (
    OnlinePeerResult,
    common_rate,
    main,
    plan_all,
    ratio,
    sustained,
)
from bench.peer.servers import vllm_server_cmd, vllm_server_env
from bench.serving.client import PlannedRequest, RateResult, send_planned


def test_plans_are_seeded_within_ranges_and_poisson_ordered():
    rates = [2.0, 8.0]
    plans = plan_all(rates, adapters=5, alpha=1.1, duration=3.0, prompt_len=(4, 9), output_len=(2, 6))
    assert plans == plan_all(rates, 5, 1.1, 3.0, (4, 9), (2, 6))  # both servers get these exact requests
    assert plans != plan_all(rates, 5, 1.1, 3.0, (4, 9), (2, 6), seed=1)
    draws = [[(p.model, p.prompt, p.max_tokens) for p in plan] for plan in plans]
    assert draws[0] != draws[1][: len(draws[0])]  # each rate has its own seed
    for plan in plans:
        ats = [p.at for p in plan]
        assert ats[0] == 0.0 and ats == sorted(ats) and ats[-1] < 3.0
        assert all(0 <= p.model < 5 for p in plan)
        assert all(4 <= len(p.prompt) <= 9 and all(3 <= t < 100 for t in p.prompt) for p in plan)
        assert all(2 <= p.max_tokens <= 6 for p in plan)
    assert len(plans[1]) > len(plans[0])  # 4x the arrival rate over the same 3 s
    with pytest.raises(ValueError, match="> 0"):
        plan_all([0.0], 5, 1.1, 3.0, (4, 9), (2, 6))


def _server(seen: list[dict], fail_model: str | None = None) -> httpx.MockTransport:
    """A stand-in OpenAI endpoint: streams `max_tokens` chunks of one token id each (or 404 for
    `fail_model`) and records every request body."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body | {"path": request.url.path})
        if body["model"] == fail_model:
            return httpx.Response(404, json={"error": {"message": "no such model"}})
        chunks = [
            {"choices": [{"index": 0, "text": "", "token_ids": [7]}]} for _ in range(body["max_tokens"])
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_both_servers_receive_the_same_requests_and_tokens_are_counted():
    names = ["a0", "a1", "a2"]
    plan = [PlannedRequest(0.0, i % 3, [5 + i] * (i + 1), 2 + i) for i in range(6)]
    seen: dict[str, list[dict]] = {"x": [], "y": []}
    results = {
        host: asyncio.run(send_planned(f"http://{host}", names, plan, 4.0, transport=_server(seen[host])))
        for host in seen
    }
    assert seen["x"] == seen["y"]
    bodies = sorted(seen["x"], key=lambda b: b["max_tokens"])
    for p, body in zip(plan, bodies, strict=True):
        assert body["path"] == "/v1/completions" and body["model"] == names[p.model]
        assert body["prompt"] == p.prompt and body["max_tokens"] == p.max_tokens
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0 and body["return_token_ids"]
    for r in results.values():
        assert (r.rate, r.sent, r.ok) == (4.0, 6, 6)
        assert math.isclose(r.output_tokens_per_s * r.duration, sum(p.max_tokens for p in plan))
    failed = asyncio.run(send_planned("http://z", names, plan, 4.0, transport=_server([], fail_model="a1")))
    assert failed.sent == 6 and failed.ok == 4  # the two a1 requests are errors, not tokens
    assert math.isclose(
        failed.output_tokens_per_s * failed.duration, sum(p.max_tokens for p in plan if p.model != 1)
    )


def _rr(rate: float, tok_s: float, p99: float, errors: int = 0) -> RateResult:
    return RateResult(rate, 20, 20 - errors, 10.0, tok_s, p99 / 2, p99, 0.02, 0.03)


def test_headline_picks_the_highest_rate_within_the_bound():
    lp = [_rr(2, 100, 0.1), _rr(4, 200, 0.3), _rr(8, 390, 0.8), _rr(16, 420, 3.0)]
    vl = [_rr(2, 95, 0.4), _rr(4, 180, 0.9), _rr(8, 250, 6.0, errors=1), _rr(16, 260, 0.5, errors=2)]
    assert sustained(lp, 1.0) is lp[2] and sustained(vl, 1.0) is vl[1]  # errors disqualify a rate
    assert sustained(lp, 0.05) is None
    assert common_rate(lp, vl, 1.0) == (lp[1], vl[1]) and common_rate(lp, vl, 0.2) is None
    assert ratio(390, 180) == 390 / 180 and ratio(1, 0) == math.inf
    res = OnlinePeerResult(
        32, 16, 2, "float32", 15.0, 1.1, (8, 64), (8, 64), 1.0, {"loraplex": lp, "vLLM": vl}
    )
    text = res.markdown()
    assert f"**{390 / 180:.2f}x**" in text  # each at its highest sustained rate: 8 vs 4 req/s
    assert f"at 4 req/s, the highest rate both sustain: loraplex / vLLM throughput {200 / 180:.2f}x" in text
    assert "| 8 | vLLM | 20 | 1 | 250 |" in text
    res.rates["vLLM"] = [_rr(2, 95, 4.0)]
    assert "vLLM none of the rates" in res.markdown()


def test_vllm_command_line():
    adapters = {"a0": "/w/adapters/0", "a1": "/w/adapters/1"}
    cmd = vllm_server_cmd(Path("/v/bin/python"), "/w/base", adapters, 4567, 16, "bfloat16")
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--model") == "/w/base" and value("--host") == "127.0.0.1" and value("--port") == "4567"
    assert value("--max-loras") == "2" and value("--max-lora-rank") == "16" and value("--dtype") == "bfloat16"
    assert "--enable-lora" in cmd and "--skip-tokenizer-init" in cmd  # token-id prompts, no tokenizer
    i = cmd.index("--lora-modules")
    assert cmd[i + 1 : i + 3] == ["a0=/w/adapters/0", "a1=/w/adapters/1"]
    auto = vllm_server_env(Path("/v/bin/python"), 2, "auto")
    assert auto["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "OMP_NUM_THREADS" not in auto
    assert auto["VLLM_CPU_KVCACHE_SPACE"] == "2"
    pinned = vllm_server_env(Path("/v/bin/python"), 2, "0-1")
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and pinned["OMP_NUM_THREADS"] == "2"


def test_plot_and_bad_arguments(tmp_path, capsys):
    res = OnlinePeerResult(2, 16, 2, "float32", 5.0, 1.1, (8, 64), (8, 64), 1.0)
    res.rates = {
        "loraplex": [_rr(2, 100, 0.1), _rr(4, 200, 0.3)],
        "vLLM": [_rr(2, 90, 0.5), _rr(4, 150, 2.0)],
    }
    plot_online_peer(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    for argv in (
        ["--rates", "2,x", "--servers", "loraplex"],
        ["--rates", "0", "--servers", "loraplex"],
        ["--servers", "loraplex,tgi"],
        ["--servers", "loraplex,loraplex"],
        ["--vllm-python", "/nope"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert "make bench-peer-venv" in capsys.readouterr().err


@pytest.mark.slow  # a real `loraplex serve` subprocess
def test_loraplex_side_end_to_end(tmp_path):
    """The loraplex half of the benchmark for real: the peer workload's adapters registered under the names
    the plan uses, `loraplex serve` started on a free port, warmed up, sent one rate, stopped."""
    from bench.peer.online import run_online_peer

    res = run_online_peer(
        None,
        tmp_path,
        [4.0],
        adapters=2,
        duration=1.0,
        prompt_len=(4, 8),
        output_len=(2, 4),
        order=("loraplex",),
    )
    (r,) = res.rates["loraplex"]
    assert r.sent >= 1 and r.ok == r.sent and r.output_tokens_per_s > 0 and r.ttft_p99 >= r.ttft_p50 > 0
    assert list(res.load_avg) == ["loraplex"] and res.start_s["loraplex"] > 0
    assert "| 4 | loraplex |" in res.markdown() and "vLLM" not in res.markdown()
    with pytest.raises(ValueError, match="virtualenv"):
        run_online_peer(None, tmp_path, [4.0], adapters=2, duration=1.0, order=("vLLM",))
