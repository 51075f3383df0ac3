"""The online serving benchmark runs against a real server and reports sane, complete results."""

from __future__ import annotations

import pytest

from bench.serving.online import OnlineResult, RateResult, pct, popularity, run
from tests.helpers.live_server import start_server

pytestmark = pytest.mark.slow  # a live server under load


def test_percentile_and_popularity():
    assert pct([], 0.99) == 0.0
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert pct(list(range(1, 101)), 0.99) == 99
    w = popularity(4, 1.0)
    assert w == sorted(w, reverse=True) and w[0] == 1.0 and w[3] == 0.25


def test_best_rate_under_threshold():
    def rr(rate, ok, p99):
        return RateResult(rate, 10, ok, 1.0, 1.0, 0.1, p99, 0.01, 0.02)

    res = OnlineResult([rr(1, 10, 0.2), rr(2, 10, 0.8), rr(4, 10, 1.5), rr(8, 9, 0.1)])
    assert res.best_rate_under(1.0) == 2  # rate 8 lost a request, rate 4 is too slow
    assert "| 4 | 10 | 10 |" in res.markdown()


def test_online_benchmark_against_live_server(text_model, tmp_path):
    srv = start_server(text_model[0], tmp_path / "data")
    try:
        result = run(srv.url, rates=[4.0], duration=2.0, prompt_len=(4, 8), output_len=(2, 4))
    finally:
        srv.stop()
    (r,) = result.rates
    assert r.sent >= 1 and r.ok == r.sent
    assert r.ttft_p50 > 0 and r.ttft_p99 >= r.ttft_p50 and r.output_tokens_per_s > 0
