"""`loraplex bench disagg --runs N`'s summary (no cluster): median and min–max per setup over the
interleaved runs, each run's disaggregated / colocated ratios against the goals, the greedy-token check;
bad flags are refused before anything starts."""

from __future__ import annotations

import random

import pytest

from bench.cluster.disagg import main, poisson_arrivals
from bench.cluster.disagg_report import SetupResult, identical_long, markdown, ratios, summary


def _result(setup: str, run: int, itl_p99: float, tok_s: float, long: dict, transfer: float | None = None,
            p999: float = float("nan")):  # fmt: skip
    return SetupResult(
        setup, 10.0, 20, 0, 100, 5.0, itl_p99, 50.0, 90.0, 300.0, 400.0, tok_s,
        transfer_ms_per_request=transfer, transfer_kib_per_request=None if transfer is None else 64.0,
        long_tokens=long, run=run, load=(3.0, 2.0, 1.0), itl_p999_ms=p999,
    )  # fmt: skip


def test_summary_ratios_and_goals_over_interleaved_runs() -> None:
    results = [
        _result("colocated", 0, 100.0, 200.0, {"L0": [1, 2], "L1": [3]}, p999=500.0),
        _result("disaggregated", 0, 40.0, 190.0, {"L0": [1, 2], "L1": [4]}, transfer=30.0, p999=50.0),
        _result("colocated", 1, 80.0, 220.0, {"L0": [1, 2]}),
        _result("disaggregated", 1, 60.0, 180.0, {"L0": [1, 2]}, transfer=40.0),
        _result("colocated", 2, 120.0, 210.0, {}),
        _result("disaggregated", 2, 30.0, 200.0, {}, transfer=35.0),
    ]
    s = summary(results)
    assert s["colocated"]["itl_p99_ms"] == {"median": 100.0, "min": 80.0, "max": 120.0}
    assert s["disaggregated"]["transfer_ms_per_request"] == {"median": 35.0, "min": 30.0, "max": 40.0}
    assert "transfer_ms_per_request" not in s["colocated"]  # not measured there
    r = ratios(results)
    assert r["itl_p99_ms"] == pytest.approx([0.4, 0.75, 0.25])  # per run's own pair, not of medians
    assert r["tokens_per_s"] == pytest.approx([0.95, 180 / 220, 200 / 210])
    assert r["itl_p999_ms"] == pytest.approx([0.1])  # runs without the p99.9 (older JSON) give none
    assert s["colocated"]["itl_p999_ms"] == {"median": 500.0, "min": 500.0, "max": 500.0}
    assert identical_long(results) == (2, 3)
    text = markdown(results)
    assert "| colocated | " in text and "100.0 (80.0–120.0)" in text
    assert "itl_p99_ms: 0.40x (0.25x–0.75x) (goal <= 0.5: met)" in text
    assert "tokens_per_s: 0.95x" in text and "(goal >= 0.9: met)" in text
    assert "itl_p999_ms: 0.10x" in text and "| ITL p99.9 (ms) |" in text
    assert "identical greedy tokens in both setups: 2 of 3" in text


@pytest.mark.parametrize(
    "argv", [["--runs", "0"], ["--setups", "colocated,nope"], ["--seconds", "0"], ["--setups", ""]]
)
def test_bad_flags_are_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_long_prompt_arrivals_stay_inside_the_window() -> None:
    """The long prompts' Poisson arrivals fall inside the run's window (a low rate used to sleep past its
    end and submit one more after the streams stopped), the same for the same seed, about rate x seconds."""
    low = poisson_arrivals(random.Random(1), 0.01, 30.0)
    assert all(0 < t < 30.0 for t in low) and len(low) <= 3
    times = poisson_arrivals(random.Random(7), 2.0, 500.0)
    assert times == sorted(times) and times[-1] < 500.0
    assert 900 < len(times) < 1100  # 1000 expected
    assert times == poisson_arrivals(random.Random(7), 2.0, 500.0)


def test_chart_of_runs_files_and_a_bad_group(tmp_path, capsys) -> None:
    """`bench.cluster.disagg_chart` draws one group per `--json` file (a file without the p99.9, written
    before it was measured, draws the p99 alone); a group that is not LABEL=FILE is refused."""
    import json

    from bench.cluster.disagg_chart import main as chart

    results = [
        _result("colocated", 0, 100.0, 200.0, {}, p999=500.0),
        _result("disaggregated", 0, 40.0, 190.0, {}, transfer=30.0, p999=50.0),
    ]
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    new.write_text(json.dumps({"summary": summary(results)}))
    summ = summary(results)
    for setup in summ.values():
        setup.pop("itl_p999_ms")
    old.write_text(json.dumps({"summary": summ}))
    out = tmp_path / "chart.png"
    chart([f"0.6/s={new}", f"0.3/s={old}", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(SystemExit) as exc:
        chart([str(new), "--out", str(out)])
    assert exc.value.code == 2 and "LABEL=FILE" in capsys.readouterr().err
