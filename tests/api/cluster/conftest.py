"""One local Ray cluster per test module: `loraplex serve --replicas 2` on the demo model, with the
registry in a throw-away PostgreSQL database (blobs in the database), events on Redis.

It starts the way an operator's machine may look: a stale Ray address file (an earlier `ray start`) and
`RAY_ADDRESS` naming a dead cluster, which a plain `--replicas` start must ignore. Ray's temporary
directory (`RAY_TMPDIR`) is the module's own, so the tests read this cluster's logs and nothing else."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.settings import ServerSettings
from lora_registry import open_registry
from lora_registry.migrate import upgrade
from tests.helpers.live_server import ADMIN_TOKEN, free_port, wait_until
from tests.helpers.redis_service import REDIS_URL, require_redis
from tests.lora_registry.pg import postgres_database
from tools.train_demo import DEMO_OUTPUTS

DEMO = Path(__file__).resolve().parents[3] / "demo"
ADAPTERS = ("upper", "reverse", "rot13", "novowels")
DEAD_RAY_ADDRESS = "127.0.0.1:1"  # nothing listens there


# What each demo model computes (demo/README.md); None is the base model (echo).
EXPECTED = DEMO_OUTPUTS


@dataclass
class Cluster:
    url: str
    settings: ServerSettings
    ray_tmp: Path  # RAY_TMPDIR of this cluster: its logs are under ray/session_latest/logs
    replica_dirs: Path  # LORAPLEX_REPLICA_DATA_DIR: where the engine replicas make their cache dirs
    startup: dict[str, float] = field(default_factory=dict)  # start-up phases (seconds), as logged

    def ray_logs(self) -> dict[str, str]:
        """Every log file of this cluster's Ray session (relative name -> text)."""
        root = self.ray_tmp / "ray" / "session_latest" / "logs"
        return {
            str(f.relative_to(root)): f.read_text(errors="replace") for f in root.rglob("*") if f.is_file()
        }

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)

    def replicas(self) -> list[dict]:
        with self.admin() as c:
            r = c.get("/admin/api/cluster")
            assert r.status_code == 200, r.text
            return r.json()["replicas"]

    def complete(self, adapter: str | None, text: str, max_tokens: int = 32) -> httpx.Response:
        """A greedy completion of `text=` (the demo models' prompt form), for `adapter` or the base."""
        path = f"/v1/adapters/{adapter}/completions" if adapter else "/v1/completions"
        body = {"prompt": f"{text}=", "max_tokens": max_tokens, "temperature": 0, "stop": ["\n"]}
        return httpx.post(self.url + path, json=body, timeout=90)

    def router_metrics(self) -> dict[tuple[str, str], float]:
        """The affinity router's samples on the ingress's `/metrics`: (sample name, its label value) ->
        value, e.g. ("loraplex_router_adapter_spreads_total", "upper")."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("loraplex_router_"):
                    out[(s.name, next(iter(s.labels.values()), ""))] = s.value
        return out


@contextmanager
def stale_ray_environment() -> Iterator[Path]:
    """A fresh `RAY_TMPDIR` (short: Ray's socket paths live under it) holding the address file of a dead
    cluster, with `RAY_ADDRESS` pointing at that dead cluster too; both restored afterwards."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="lpx-ray-", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(DEAD_RAY_ADDRESS)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_TMPDIR", str(ray_tmp))
            mp.setenv("RAY_ADDRESS", DEAD_RAY_ADDRESS)
            yield ray_tmp
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster_overrides() -> dict:
    """What a test module changes in its cluster: {"engine": engine kwargs, "options": ClusterOptions
    kwargs} (override this fixture in the module)."""
    return {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cluster_overrides: dict):
    options = {"replicas": 2, **cluster_overrides.get("options", {})}
    with running_cluster(tmp_path_factory, cluster_overrides.get("engine"), **options) as c:
        yield c


@contextmanager
def running_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    engine_kwargs: dict | None = None,
    model: Path = DEMO / "base",
    adapters: dict[str, Path] | None = None,
    **options,
) -> Iterator[Cluster]:
    """A local Ray cluster serving `model` (the demo model unless given) with `adapters` registered and
    active (name -> PEFT dir; the demo adapters unless given) and `ClusterOptions(**options)` (see the
    module doc); `engine_kwargs` override the engine's settings."""
    from api.cluster import ray_api
    from api.cluster.run import ClusterOptions, start_cluster

    require_redis()
    data_dir = tmp_path_factory.mktemp("cluster") / "data"
    replica_dirs = tmp_path_factory.mktemp("replicas")
    with (
        postgres_database() as db_url,
        stale_ray_environment() as ray_tmp,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("LORAPLEX_REPLICA_DATA_DIR", str(replica_dirs))  # the replicas inherit the driver's env
        upgrade(db_url)
        env = {
            "LORAPLEX_DATA_DIR": str(data_dir),
            "LORAPLEX_DATABASE_URL": db_url,
            "LORAPLEX_REDIS_URL": REDIS_URL,
            "LORAPLEX_BLOB_STORE": "database",
            "LORAPLEX_MODEL": str(model),
        }
        engine = dict(device="cpu", dtype="float32", num_threads=1, num_kv_blocks=128, max_loras=4)
        engine |= engine_kwargs or {}
        settings = ServerSettings.build(str(model), env=env, admin_token=ADMIN_TOKEN, engine_kwargs=engine)
        settings.registry = dataclasses.replace(
            settings.registry, redis_channel=f"loraplex-test-{secrets.token_hex(4)}"
        )
        settings.registry_resync_seconds = 5.0
        settings.shutdown_grace_seconds = 2.0
        settings.port = free_port()
        reg = open_registry(settings.registry)
        try:
            for name, path in (adapters or {n: DEMO / "adapters" / n for n in ADAPTERS}).items():
                reg.adapters.register(name, path, activate=True)
        finally:
            reg.close()
        # Ray sends a request to a replica without its adapter once no replica holding it took the
        # request within 1-2 s (Serve's default); on a busy 2-core machine the replicas' queue probes
        # alone can take that long. The workers inherit this from the driver's environment.
        os.environ.setdefault("RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S", "10")
        try:
            startup = start_cluster(settings, ClusterOptions(num_cpus=2, **options))
            url = f"http://127.0.0.1:{settings.port}"
            assert wait_until(lambda: _healthy(url), timeout=120), "the cluster did not become healthy"
            yield Cluster(url, settings, ray_tmp, replica_dirs, startup)
        finally:
            ray_api.shutdown()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
