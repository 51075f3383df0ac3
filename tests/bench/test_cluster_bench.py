"""The cluster benchmark's pure parts (the benchmark itself needs a Ray cluster and runs by hand)."""

from __future__ import annotations

import itertools

from bench.cluster.affinity import PhaseResult, make_adapters, markdown, popularity
from engine.lora.adapter_checkpoint import adapter_digest


def test_adapters_are_distinct_copies_of_the_demo_adapters(tmp_path) -> None:
    paths = make_adapters(tmp_path, 6, tag=1)
    digests = {adapter_digest(p) for p in paths}
    assert len(digests) == 6


def test_popularity_is_a_decreasing_distribution() -> None:
    p = popularity(16, 1.0)
    assert abs(sum(p) - 1.0) < 1e-9 and all(a > b for a, b in itertools.pairwise(p))
    assert abs(p[0] / p[3] - 4.0) < 1e-9


def test_markdown_reports_ratios() -> None:
    balanced = PhaseResult("balanced", 1000, 1000, 50.0, 16000, 200, 300, 0)
    multiplexed = PhaseResult("multiplexed", 1000, 1000, 40.0, 16000, 20, 30, 25)
    text = markdown([balanced, multiplexed])
    assert "| balanced | 1000 (1000) | 200 | 300 | 20.0 | 320 |" in text
    assert "10.0x fewer device uploads, 10.0x fewer host loads, 1.25x the throughput" in text
