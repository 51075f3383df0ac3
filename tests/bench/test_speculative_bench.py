"""`loraplex bench offline --speculative ngram` end to end at a tiny size: same tokens, and the echo task
(output copies the prompt) accepts most proposals."""

from __future__ import annotations

import pytest

from bench.offline.throughput import main

pytestmark = pytest.mark.slow  # two demo engines


def test_offline_speculative_runs_and_reports(tmp_path, capsys):
    result = main(["--speculative", "ngram", "--batches", "2", "--spec-repeats", "1", "--no-random"])
    cells = {c.task: c for c in result.cells}
    assert set(cells) == {f"demo {t}" for t in ("echo", "upper", "reverse", "rot13", "novowels", "mixed")}
    assert all(c.identical for c in result.cells)
    echo = cells["demo echo"]
    assert echo.mean_acceptance_length > 2.5 and echo.acceptance_rate > 0.5
    assert echo.spec_steps < echo.plain_steps
    out = capsys.readouterr().out
    assert "| demo echo | 2 | 16 |" in out and "mean acceptance length" in out
