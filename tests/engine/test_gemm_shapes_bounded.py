"""A long-running CPU engine builds oneDNN primitives for a bounded set of GEMM shapes.

oneDNN caches one primitive per distinct (rows, weight) shape, and a step's row count can take any value
up to the token budget, so an engine serving prompts of every length kept adding cached primitives for a
long time (RSS growing under a steady soak, `bench/soak.py`). Float32 packed GEMMs now run at
`row_bucket(rows)` rows: whatever the traffic, only the few dozen bucket sizes reach oneDNN."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.model.cpu_gemm import (
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_VARIABLES,
    bound_onednn_caches,
    row_bucket,
)

BUCKETS = {row_bucket(t) for t in range(1, 4097)}


def test_row_buckets_are_few_and_tight():
    assert len({row_bucket(t) for t in range(1, 2049)}) == 35
    for t in range(1, 4097):
        b = row_bucket(t)
        assert b >= t and row_bucket(b) == b
        assert b == t if t <= 8 else b - t < 8 if t <= 64 else b <= 1.25 * t


@pytest.mark.slow
def test_engine_gemm_row_counts_stay_in_the_buckets(checkpoint, monkeypatch):
    """Requests of many prompt lengths, added between steps and some aborted: every packed GEMM the
    engine runs has a bucket's row count, so the set of oneDNN shapes stays small."""
    real = torch.ops.mkldnn._linear_pointwise
    rows: set[int] = set()

    def spy(x, *args):
        rows.add(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    eng = LLMEngine.from_args(str(checkpoint("llama")), device="cpu", dtype="float32")
    rng = random.Random(0)
    for i in range(60):
        prompt = [rng.randint(3, 90) for _ in range(rng.randint(1, 60))]
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0))
        for _ in range(rng.randint(0, 2)):
            eng.step()
        if i % 9 == 0:
            eng.abort_request(f"r{i - 1}")
    while eng.has_unfinished_requests():
        eng.step()
    assert len(rows) > 10  # the traffic did produce many step sizes
    assert rows <= BUCKETS, sorted(rows - BUCKETS)


def test_onednn_caches_are_capped_unless_the_environment_says_otherwise(monkeypatch):
    """The engine process caps both primitive caches (their own default is 1,024 entries each); a value
    already in the environment wins."""
    for var in ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "32")
    bound_onednn_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "32"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY) != "1024"
