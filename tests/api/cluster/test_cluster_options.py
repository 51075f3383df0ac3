"""`--replicas` layout options without a cluster: Ray resource requests per replica, ingress replicas,
drain timeouts, and the CLI's refusal of impossible layouts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from api.cli.main import app
from api.cluster.options import ClusterOptions, RouterQueue
from api.settings import ServerSettings
from tests.api.cluster.conftest import DEMO


def _settings(tmp_path) -> ServerSettings:
    settings = ServerSettings.build(str(DEMO / "base"), env={"LORAPLEX_DATA_DIR": str(tmp_path)})
    settings.shutdown_grace_seconds = 7.0
    return settings


def test_replicas_request_their_cpus_and_gpus_from_ray(tmp_path) -> None:
    from api.cluster.deployments import engine_deployment, ingress_deployment

    settings = _settings(tmp_path)
    options = ClusterOptions(3, cpus_per_replica=2, gpus_per_replica=1, ingress_replicas=2)
    engine = engine_deployment(settings, options)
    assert engine.num_replicas == 3
    assert engine.ray_actor_options == {"num_cpus": 2, "num_gpus": 1}
    ingress = ingress_deployment(settings, options)
    assert ingress.num_replicas == 2
    # replicas drain for the shutdown grace (plus time to write the 503s) before Serve stops them
    assert ingress._deployment_config.graceful_shutdown_timeout_s >= 7.0
    assert engine._deployment_config.graceful_shutdown_timeout_s >= 7.0
    assert engine._deployment_config.health_check_period_s <= 1.0
    default = engine_deployment(settings, ClusterOptions(2))
    assert default.ray_actor_options == {"num_cpus": 0}  # engines pin their own threads


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--ingress-replicas", "0"), ("--gpus-per-replica", "-1"), ("--cpus-per-replica", "-2")],
)
def test_cli_refuses_impossible_layouts(tmp_path, flag: str, value: str) -> None:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "1", "--replicas", "2", flag, value], env=env)
    assert result.exit_code == 2 and flag in result.output, result.output


def test_the_affinity_router_is_the_default_and_multiplex_an_option(tmp_path) -> None:
    from api.cluster.deployments import engine_deployment
    from api.cluster.options import RouterWeights, SpreadPolicy

    settings = _settings(tmp_path)
    weights = RouterWeights(prefix=3.0, adapter=0.5, load=1.5)
    spread = SpreadPolicy(load=0.25, max_replicas=3, contract_after_s=4.0)
    options = ClusterOptions(2, router_weights=weights, spread=spread)
    config = engine_deployment(settings, options)._deployment_config
    router = config.request_router_config
    assert router.request_router_class == "api.cluster.affinity_router.AffinityRouter"
    assert router.request_router_kwargs == {
        "block_size": settings.engine.block_size,
        "w_prefix": 3.0,
        "w_adapter": 0.5,
        "w_load": 1.5,
        "spread_load": 0.25,
        "max_spread": 3,
        "contract_after_s": 4.0,
        "hold_margin": RouterQueue().hold_margin,
    }
    assert router.request_routing_stats_period_s <= 1.0  # residency reaches the router within a second
    plain = engine_deployment(settings, ClusterOptions(2, router="multiplex"))._deployment_config
    assert "AffinityRouter" not in str(plain.request_router_config.request_router_class)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--router", "random"], "--router must be one of"),
        (["--router-w-load", "-1"], "--router-w-load"),
        (["--router-max-spread", "0"], "--router-max-spread"),
        (["--router-spread-load", "0"], "--router-spread-load"),
        (["--router-contract-after", "-1"], "--router-contract-after"),
        (["--router-max-ongoing", "0"], "--router-max-ongoing"),
        (["--router-hold-margin", "-1"], "--router-hold-margin"),
    ],
)
def test_cli_refuses_unknown_routers_and_negative_weights(tmp_path, args: list[str], message: str) -> None:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "1", "--replicas", "2", *args], env=env)
    assert result.exit_code != 0 and message in result.output, result.output


def test_autoscaling_options_become_serves_autoscaling_config(tmp_path) -> None:
    from api.cluster.deployments import engine_deployment

    settings = _settings(tmp_path)
    options = ClusterOptions(2, min_replicas=1, max_replicas=4, target_ongoing_requests=24)
    config = engine_deployment(settings, options)._deployment_config
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 4)
    assert scaling.target_ongoing_requests == 24
    # without a target: a replica is at its target with a full running batch
    default = engine_deployment(settings, ClusterOptions(1, max_replicas=3))._deployment_config
    assert default.autoscaling_config.min_replicas == 1
    assert default.autoscaling_config.target_ongoing_requests == settings.engine.max_num_seqs
    fixed = engine_deployment(settings, ClusterOptions(3))._deployment_config
    assert fixed.autoscaling_config is None and fixed.num_replicas == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (ClusterOptions(2, min_replicas=3, max_replicas=2), "is below --min-replicas"),
        (ClusterOptions(5, min_replicas=1, max_replicas=4), "must lie between"),
        (ClusterOptions(1, min_replicas=0, max_replicas=4), "--min-replicas must be at least 1"),
        (ClusterOptions(2, min_replicas=2), "need --max-replicas"),
        (ClusterOptions(2, target_ongoing_requests=8), "need --max-replicas"),
        (ClusterOptions(1, max_replicas=2, target_ongoing_requests=0), "must be positive"),
    ],
)
def test_impossible_autoscaling_is_refused(options: ClusterOptions, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        options.validate()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-replicas", "3", "--max-replicas", "2"], "is below --min-replicas"),
        (["--replicas", "4", "--max-replicas", "2"], "must lie between"),
        (["--target-ongoing-requests", "8"], "need --max-replicas"),
        (["--min-replicas", "0", "--max-replicas", "2"], "--min-replicas"),
    ],
)
def test_cli_refuses_impossible_autoscaling(tmp_path, args: list[str], message: str) -> None:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "1", *args], env=env)
    assert result.exit_code != 0 and message in result.output, result.output
