"""`bench.cluster.serve_sim`: Serve's dispatch in front of the simulated replicas keeps the backlog where
`max_ongoing_requests` says (Serve's queue or the engines'), and serves every request once."""

from __future__ import annotations

import pytest

from api.cluster.options import RouterWeights, SpreadPolicy
from bench.cluster.router_sweep import Sim, workload
from bench.cluster.serve_sim import ServeModel, run_serve


@pytest.mark.parametrize("router", ["affinity", "multiplex", "pow2"])
def test_the_backlog_waits_in_serves_queue_or_in_the_engines(router: str) -> None:
    reqs = workload(240, 20.0, seed=1)  # 3x what two replicas drain: a backlog builds
    sim = Sim()
    capped = run_serve(reqs, 2, RouterWeights(), SpreadPolicy(), sim, ServeModel(router, sim.max_seqs))
    assert capped["peak_serve_queue"] > 0 and capped["peak_engine_waiting"] == 0
    deep = run_serve(reqs, 2, RouterWeights(), SpreadPolicy(), sim, ServeModel(router, 1000))
    assert deep["peak_serve_queue"] == 0 and deep["peak_engine_waiting"] > 0
    for result in (capped, deep):
        assert 0 < result["prefix_hit_rate"] < 1 and result["throughput"] > 0
