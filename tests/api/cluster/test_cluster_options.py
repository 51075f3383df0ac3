"""`--replicas` layout options without a cluster: Ray resource requests per replica, ingress replicas,
drain timeouts, and the CLI's refusal of impossible layouts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from api.cli.main import app
from api.cluster.options import ClusterOptions
from api.settings import ServerSettings
from tests.api.cluster.conftest import DEMO

pytest.importorskip("ray.serve")


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
