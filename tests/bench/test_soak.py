"""The soak benchmark's parts (slope, process lookup, workload) and one short run against a real server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.serving.soak import ADAPTERS, _request, main, parse_args, rss_mib, server_pids, slope_per_min


def test_slope_is_mib_per_minute():
    assert slope_per_min([(0.0, 100.0), (30.0, 101.0), (60.0, 102.0)]) == pytest.approx(2.0)
    assert slope_per_min([(0.0, 5.0)]) == 0.0 and slope_per_min([(1.0, 5.0), (1.0, 6.0)]) == 0.0


def test_server_pids_finds_the_serve_process_and_its_largest_child():
    child = "x = b'x' * (64 << 20); import time; time.sleep(30)"  # a child of about 70 MiB
    code = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", "1"])
    found: tuple[int, int] | None = None
    try:
        deadline = time.monotonic() + 20
        while found is None or (rss_mib(found[1]) or 0) < 60:
            assert time.monotonic() < deadline
            time.sleep(0.1)
            with contextlib.suppress(RuntimeError):  # not started yet
                found = server_pids(1)
        assert found[0] == proc.pid and found[1] != proc.pid
    finally:
        if found is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(found[1], signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_requests_name_a_served_model_and_the_arguments_are_checked():
    import random

    rng = random.Random(0)
    bodies = [_request(rng)[1] for _ in range(200)]
    assert {b["model"] for b in bodies} == {"demo-base", *ADAPTERS}
    assert any(b.get("stream") for b in bodies) and any("messages" in b for b in bodies)
    with pytest.raises(SystemExit):
        parse_args(["--rate", "0"])


@pytest.mark.slow
def test_a_short_soak_reports_both_processes(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert (
        main(
            ["--duration", "6", "--warmup", "1", "--rate", "4", "--sample-every", "0.5", "--quiet"]
            + ["--quiet-server", "--json", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| api |" in text and "| engine |" in text and " 0 failed" in text
    assert out.stat().st_size > 0
