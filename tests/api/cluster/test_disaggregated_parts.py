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
    assert ClusterOptions(0, prefill_replicas=1, decode_replicas=1).kv_transfer_timeout_s == 30.0
    ClusterOptions(0, prefill_replicas=1, decode_replicas=1, kv_transfer_timeout_s=0.5).validate()
    for bad in (0.0, -1.0, 4000.0):
        with pytest.raises(ValueError, match="--kv-transfer-timeout"):
            ClusterOptions(0, prefill_replicas=1, decode_replicas=1, kv_transfer_timeout_s=bad).validate()


def test_local_prefill_tokens_apply_to_the_disaggregated_layout_only() -> None:
    assert ClusterOptions(0, prefill_replicas=1, decode_replicas=1).local_prefill_tokens == 0
    ClusterOptions(0, prefill_replicas=1, decode_replicas=1, local_prefill_tokens=256).validate()
    with pytest.raises(ValueError, match="cannot be negative"):
        ClusterOptions(0, prefill_replicas=1, decode_replicas=1, local_prefill_tokens=-1).validate()
    with pytest.raises(ValueError, match="--local-prefill-tokens applies"):
        ClusterOptions(2, local_prefill_tokens=8).validate()
    ClusterOptions(2).validate()


def test_decode_router_ranks_whole_requests_by_their_adapter() -> None:
    """`generate(digest, payload)` (a short prompt served whole by a decode replica) is ranked by its
    adapter as `prepare` is; `decode` goes to the replica it was prepared on."""
    from types import SimpleNamespace

    from api.cluster.disaggregated.decode_router import _request

    def pending(method: str, *args):
        return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=list(args))

    assert _request(pending("generate", A, b"payload")) == (A, None)
    assert _request(pending("generate", "", b"payload")) == (None, None)
    assert _request(pending("prepare", A, "name")) == (A, None)
    assert _request(pending("decode", "r1", object(), A)) == (A, "r1")


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


def test_deployments_and_routers_of_the_disaggregated_layout(tmp_path) -> None:
    from api.cluster.disaggregated.app import decode_deployment, prefill_deployment
    from api.settings import ServerSettings
    from tests.api.cluster.conftest import DEMO

    settings = ServerSettings.build(str(DEMO / "base"), env={"LORAPLEX_DATA_DIR": str(tmp_path)})
    options = ClusterOptions(0, prefill_replicas=2, decode_replicas=3, gpus_per_replica=1)
    pre, dec = prefill_deployment(settings, options), decode_deployment(settings, options)
    assert (pre.num_replicas, dec.num_replicas) == (2, 3)
    assert pre.ray_actor_options["num_gpus"] == dec.ray_actor_options["num_gpus"] == 1
    routers = [d._deployment_config.request_router_config.request_router_class for d in (pre, dec)]
    assert routers == [
        "api.cluster.affinity_router.AffinityRouter",
        "api.cluster.disaggregated.decode_router.DecodeRouter",
    ]


BOTH = ["--prefill-replicas", "1", "--decode-replicas", "1"]


@pytest.mark.parametrize("flags", [BOTH[:2], BOTH[2:], ["--replicas", "2", *BOTH]])
def test_cli_refuses_half_a_disaggregated_layout(tmp_path, flags: list[str]) -> None:
    from typer.testing import CliRunner

    from api.cli.main import app
    from tests.api.cluster.conftest import DEMO

    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "0", *flags], env=env)
    assert result.exit_code == 1 and "go together" in result.output, result.output


def test_cli_refuses_a_transfer_timeout_without_disaggregation(tmp_path) -> None:
    from typer.testing import CliRunner

    from api.cli.main import app
    from tests.api.cluster.conftest import DEMO

    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--kv-transfer-timeout", "5"], env=env)
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "--kv-transfer-timeout applies to --prefill-replicas" in said, said


def test_cli_refuses_local_prefill_tokens_without_disaggregation(tmp_path) -> None:
    from typer.testing import CliRunner

    from api.cli.main import app
    from tests.api.cluster.conftest import DEMO

    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--local-prefill-tokens", "64"], env=env)
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "--local-prefill-tokens applies to --prefill-replicas" in said, said


def test_prefill_worker_releases_held_chunks_on_ack_else_after_the_timeout() -> None:
    """`PrefillWorker` keeps a handoff's chunk refs until `release` (the decode side acknowledged the
    import), and drops them after `hold_s` when no release comes."""
    import asyncio

    from api.cluster.disaggregated.handoff import Handoff
    from api.cluster.disaggregated.replicas import PrefillWorker

    async def run() -> None:
        worker = PrefillWorker(replica=None, hold_s=0.2)  # type: ignore[arg-type]  # unused here
        acked, lost = (Handoff(rid, b"", b"", [object()], 1, 1.5) for rid in ("a", "b"))
        worker._hold(acked)
        worker._hold(lost)
        assert set(worker.held) == {acked.key, lost.key}
        assert worker.release(acked.key) and not worker.release(acked.key)
        assert not worker.release("other@1.0")  # another prefill replica's
        assert set(worker.held) == {lost.key}
        await asyncio.sleep(0.4)
        assert worker.held == {}

    asyncio.run(run())


def test_kv_staging_option() -> None:
    layout = dict(prefill_replicas=1, decode_replicas=1)
    assert ClusterOptions(0, **layout).kv_staging == "shm"
    ClusterOptions(0, kv_staging="zmq", **layout).validate()
    with pytest.raises(ValueError, match="--kv-staging"):
        ClusterOptions(0, kv_staging="nfs", **layout).validate()


@pytest.mark.parametrize("flags", [["--kv-staging", "shm"], ["--prefill-replicas", "1", "--decode-replicas",
                                                            "1", "--kv-staging", "nfs"]])  # fmt: skip
def test_cli_refuses_a_bad_or_misplaced_kv_staging(tmp_path, flags: list[str]) -> None:
    from typer.testing import CliRunner

    from api.cli.main import app
    from tests.api.cluster.conftest import DEMO

    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "0", *flags], env=env)
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "--kv-staging is one of shm, zmq" in said, said
