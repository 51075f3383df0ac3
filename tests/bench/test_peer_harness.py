"""The vLLM peer benchmark's harness (`bench.peer.offline.run_peer`) end to end, with a stand-in for the vLLM
runner: the real loraplex engine on a tiny model, legs interleaved, each repeat's pair of legs compared,
and every leg started only once the stand-in has stopped spinning (like vLLM's post-batch polling)."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from bench.gpu.e2e import SIZES
from bench.peer.offline import run_peer

# Answers the runner protocol (`bench/peer/vllm_runner.py`) with fixed times: mixed 0.2 s, base 0.1 s.
# After each answer it spins for SPIN_S, as vLLM's engine polls after a batch, and records when it stopped.
SPIN_S = 0.4
FAKE_RUNNER = textwrap.dedent(
    f"""
    import json, sys, time
    spec = json.load(open(sys.argv[2]))
    log = open(sys.argv[2] + ".spins", "a")
    def say(obj):
        print("PEER " + json.dumps(obj), flush=True)
    say({{"ready": 0.01}})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        tokens = [[0] * spec["new_tokens"] for _ in spec["prompts"]]
        say({{"seconds": 0.2 if cmd == "mixed" else 0.1, "tokens": tokens}})
        end = time.monotonic() + {SPIN_S}
        while time.monotonic() < end:
            pass
        log.write(f"{{time.time()}}\\n")
        log.flush()
    """
)


@pytest.mark.slow
def test_run_peer_pairs_repeats_and_waits_for_the_peer(tmp_path, monkeypatch):
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {runner} "$@"\n')
    python.chmod(0o755)
    starts: list[float] = []  # wall-clock start of every loraplex leg
    import bench.common.workload

    real_timed_run = bench.common.workload.timed_run

    def timed_run(*args, **kwargs):
        starts.append(time.time())
        return real_timed_run(*args, **kwargs)

    monkeypatch.setattr(bench.common.workload, "timed_run", timed_run)
    res = run_peer(
        python, tmp_path / "w", repeats=2, threads=1, quiet=True,
        adapters=2, requests=3, rank=4, prompt_len=4, new_tokens=3, spec=SIZES["tiny"],
    )  # fmt: skip
    assert set(res.pairs) == {"mixed", "base", "base vs compiled"}
    assert all(len(v) == 2 for v in res.pairs.values())
    # a repeat's ratio: the stand-in's time over that repeat's loraplex leg (the best leg: the largest)
    assert max(res.pairs["mixed"]) == pytest.approx(0.2 / res.seconds["mixed"])
    assert max(res.pairs["base vs compiled"]) <= 0.1 / res.seconds["base"] + 1e-9
    assert "per interleaved repeat" in res.markdown()
    spins = [float(x) for p in (tmp_path / "w").glob("*.json.spins") for x in p.read_text().split()]
    assert len(spins) >= 6  # warm-up, 2 x (mixed, base), the compiled runner's base legs
    # no loraplex leg started while the stand-in was still spinning after a batch
    for t in starts[1:]:  # the first (warm-up) leg runs before the stand-in exists
        assert not any(end - SPIN_S < t < end for end in spins), (t, spins)
    assert os.path.exists(tmp_path / "w" / "vllm.log")
