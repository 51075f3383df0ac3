"""`--replicas` layout options without a cluster: Ray resource requests per replica, ingress replicas,
drain timeouts, and the CLI's refusal of impossible layouts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from api.cli.main import app
from api.cluster.options import ClusterOptions
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
    ],
)
def test_cli_refuses_unknown_routers_and_negative_weights(tmp_path, args: list[str], message: str) -> None:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_MODEL": str(DEMO / "base")}
    result = CliRunner().invoke(app, ["serve", "--port", "1", "--replicas", "2", *args], env=env)
    assert result.exit_code != 0 and message in result.output, result.output
