"""The disaggregated layout's plain parts (no Ray): options, the decode replica score, the handoff's
wire forms."""

from __future__ import annotations

import pytest

from api.cluster.disaggregated.decode_score import DecodeView, DecodeWeights, rank, score
from api.cluster.options import ClusterOptions

A = "a" * 64


def test_options_take_one_layout() -> None:
    ClusterOptions(0, prefill_replicas=1, decode_replicas=2).validate()
    with pytest.raises(ValueError, match="go together"):
        ClusterOptions(0, prefill_replicas=1).validate()
    with pytest.raises(ValueError, match="not both"):
        ClusterOptions(2, prefill_replicas=1, decode_replicas=1).validate()
    with pytest.raises(ValueError, match="at least 1"):
        ClusterOptions(0).validate()


def test_decode_score_prefers_residency_then_free_blocks_then_load() -> None:
    w = DecodeWeights()
    holds = DecodeView("r1", device=frozenset({A}), kv_free=10, kv_total=100)
    empty = DecodeView("r2", kv_free=100, kv_total=100)
    assert score(holds, A, w) > score(DecodeView("r3", host=frozenset({A}), kv_free=10, kv_total=100), A, w)
    # residency (1.0) outweighs free blocks (0.9) at the default weights; the base model has no term
    assert [v.replica_id for v in rank([empty, holds], A, w)] == ["r1", "r2"]
    assert [v.replica_id for v in rank([holds, empty], None, w)] == ["r2", "r1"]
    busy = DecodeView("r2", kv_free=100, kv_total=100, max_seqs=4, in_flight=4)
    assert [v.replica_id for v in rank([busy, holds], None, w)] == ["r1", "r2"]
    # a request prepared on a replica goes there whatever the scores say
    assert rank([holds, empty], None, w, prefer="r1")[0].replica_id == "r1"
    # a replica that has not reported counts as empty
    assert score(DecodeView("new"), None, w) == pytest.approx(1.0)
