"""The affinity router's placement on a live cluster (2 replicas, each running at most 2 sequences): a hot
adapter at 4x one replica's capacity spreads to the other replica and contracts again when its load
falls, answering exactly throughout; base-model prompts with nothing in common spread by load."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.cluster.options import SpreadPolicy
from tests.api.cluster.conftest import EXPECTED, Cluster
from tests.helpers.live_server import wait_until

pytestmark = pytest.mark.slow
MAX_SEQS = 2
CONTRACT_AFTER_S = 2.0


@pytest.fixture(scope="module")
def cluster_overrides() -> dict:
    return {
        "engine": {"max_num_seqs": MAX_SEQS},
        "options": {"spread": SpreadPolicy(contract_after_s=CONTRACT_AFTER_S)},
    }


def _burst(cluster: Cluster, adapter: str | None, texts: list[str]) -> list[str]:
    """Send every text at once; asserts each answer is exact; returns the replica of each."""
    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda t: (t, cluster.complete(adapter, t)), texts))
    for text, r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == EXPECTED[adapter](text), (adapter, text)
    return [r.headers["x-loraplex-replica"] for _, r in answers]


def _pinned(cluster: Cluster, digest: str) -> set[str]:
    return {r["replica"] for r in cluster.replicas() if digest in r.get("pinned_hot", [])}


def test_a_hot_adapter_spreads_then_contracts_with_exact_answers(cluster: Cluster) -> None:
    first = cluster.complete("upper", "warm up")
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == "WARM UP"
    home = first.headers["x-loraplex-replica"]
    assert cluster.router_metrics().get(("loraplex_router_adapter_replicas", "upper")) == 1
    digest = next(r["active"]["upper"] for r in cluster.replicas())
    texts = [f"hot request {c}" for c in "abcdefgh"[: 4 * MAX_SEQS]]  # 4x one replica's capacity at once
    served: set[str] = set()
    pinned: set[str] = set()
    for _ in range(6):  # until both replicas pin the hot adapter (they see its pages on device)
        served |= set(_burst(cluster, "upper", texts))
        pinned = _pinned(cluster, digest)
        if len(served) == 2 and len(pinned) == 2:
            break
    assert len(served) == 2 and home in served, served
    assert len(pinned) == 2, "the replicas do not pin the spread adapter"
    metrics = cluster.router_metrics()
    assert metrics[("loraplex_router_adapter_spreads_total", "upper")] >= 1
    assert metrics[("loraplex_router_adapter_replicas", "upper")] == 2

    # one request at a time, a second apart (the router learns that a request ended from Serve's
    # callbacks, which a busy machine may run after the next request's routing): the load would fit on
    # one replica; after CONTRACT_AFTER_S it contracts
    def contracted() -> bool:
        r = cluster.complete("upper", "cool down")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "COOL DOWN"
        return cluster.router_metrics()[("loraplex_router_adapter_replicas", "upper")] == 1

    started = time.monotonic()
    assert wait_until(contracted, timeout=90, interval=1.0), "the adapter stayed spread"
    assert time.monotonic() - started >= CONTRACT_AFTER_S * 0.9
    assert cluster.router_metrics()[("loraplex_router_adapter_contractions_total", "upper")] >= 1
    after = {cluster.complete("upper", t).headers["x-loraplex-replica"] for t in ("a b", "c d", "e f")}
    assert len(after) == 1, after
    assert wait_until(lambda: not _pinned(cluster, digest), timeout=20), "pins outlived the spread"


def test_distinct_base_prompts_spread_by_load(cluster: Cluster) -> None:
    letters = "abcdefghijklmnopqrstuvwxyz"
    texts = ["".join(letters[(7 * i + 3 * j) % 26] for j in range(20)) for i in range(4 * MAX_SEQS)]
    replicas = _burst(cluster, None, texts)
    assert len(set(replicas)) == 2, replicas
    assert min(replicas.count(r) for r in set(replicas)) >= 2, replicas
