"""SIGTERM under load on a real `loraplex serve --replicas 2` process (PostgreSQL registry, blobs in the
database, Redis events), started with a stale Ray address file and `RAY_ADDRESS` naming a dead cluster.

The start is a new local cluster (engine replicas autoscaled: Serve's controller holds the flags' config),
logs its phases and has no ingress crash; on SIGTERM the requests in
flight finish within `--shutdown-grace` or end with the single server's contract (a retryable 503 with
the OpenAI body, or an SSE error event then `data: [DONE]`); the process exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.api.cluster.conftest import DEMO, stale_ray_environment
from tests.helpers.live_server import ADMIN_TOKEN, free_port, wait_until
from tests.helpers.redis_service import REDIS_URL, require_redis
from tests.helpers.shutdown_load import check_outcome, healthy, one_long_request
from tests.lora_registry.pg import postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]
GRACE = 0.3
CLIENTS = 32


def cluster_deployment(url: str) -> dict | None:
    """The engine deployment's scale as `GET /admin/api/cluster` reports it (from Serve's controller)."""
    r = httpx.get(f"{url}/admin/api/cluster", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["replicas"]) == 2
    return r.json()["deployment"]


def test_sigterm_under_load_drains_with_the_grace(tmp_path: Path) -> None:
    from lora_registry.migrate import upgrade

    require_redis()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with postgres_database() as db_url, stale_ray_environment() as ray_tmp:
        upgrade(db_url)
        env = os.environ | {
            "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
            "LORAPLEX_DATABASE_URL": db_url,
            "LORAPLEX_REDIS_URL": REDIS_URL,
            "LORAPLEX_BLOB_STORE": "database",
            "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN,
            "LORAPLEX_REPLICA_DATA_DIR": str(tmp_path / "replicas"),
        }
        loraplex = str(Path(sys.executable).parent / "loraplex")
        cmd = [loraplex, "serve", "--model", str(DEMO / "base"), "--port", str(port), "--device", "cpu"]
        cmd += ["--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128", "--max-num-seqs", "2"]
        cmd += ["--max-seqs-per-client", str(CLIENTS), "--shutdown-grace", str(GRACE)]
        # autoscaled between 1 and 2 replicas, starting with 2 (Serve waits 600 s before scaling down)
        cmd += ["--replicas", "2", "--min-replicas", "1", "--max-replicas", "2"]
        cmd += ["--target-ongoing-requests", "64"]
        cmd += [
            "--ray-num-cpus",
            "2",
            "--cpus-per-replica",
            "0.5",
            "--ingress-replicas",
            "1",
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
        reader.start()
        results: list = []
        try:
            # every replica is up once the driver logs its start-up phases (/health needs just one)
            ready = wait_until(
                lambda: any("cluster ready in" in line for line in lines), timeout=300, interval=0.5
            )
            assert ready, "".join(lines)
            assert healthy(url)
            scale = cluster_deployment(url)
            started = threading.Event()
            threads = [
                threading.Thread(target=one_long_request, args=(url, i, results, started, 56))
                for i in range(CLIENTS)
            ]
            for t in threads:
                t.start()
            assert started.wait(60), "no stream started"
            time.sleep(0.3)  # the requests have reached the ingress
            logs = ray_tmp / "ray" / "session_latest" / "logs"
            crashes = [
                f.name
                for f in logs.rglob("*")
                if f.is_file() and "DeploymentUnavailableError" in f.read_text(errors="replace")
            ]
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            for t in threads:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in threads), "a request hung"
            drained = max(r[4] for r in results)
            code = proc.wait(timeout=120)
            exited = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
            reader.join(timeout=10)
            out = "".join(lines)
    assert code == 0, out
    # the autoscaling flags reached Serve's controller
    assert scale is not None and scale["target_replicas"] == 2, scale
    auto = scale["autoscaling"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (1, 2, 2), auto
    assert auto["target_ongoing_requests"] == 64, auto
    assert not crashes, crashes
    assert "cluster ready in" in out and "started local" in out, out
    assert "Traceback" not in out, out
    assert len(results) == CLIENTS
    cut: list[str] = []
    for kind, status, ctype, body, _ in results:
        assert kind != "broken", body
        check_outcome(kind, status, ctype, body, cut)
    assert cut, "no request was still running at the end of the grace period: the test did not test it"
    assert drained - signalled < GRACE + 10, drained - signalled  # requests end soon after the grace
    assert "draining:" in out and "loraplex stopped" in out, out
    print(f"drained {drained - signalled:.1f} s after SIGTERM; exited {exited - drained:.1f} s later")
