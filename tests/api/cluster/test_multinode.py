"""docs/deploy.md's multi-node runbook, run for real: a Ray head (`ray start --head`) and a second Ray node
(`ray start --address`), each with its own temporary dir, 2 logical CPUs (the machine may have fewer) and
its own `LORAPLEX_REPLICA_DATA_DIR`; then `loraplex serve --replicas 2 --tensor-parallel-size 2
--threads 2 --ray-address ...` on them (PostgreSQL registry, blobs in the database, Redis events).

Each replica's two ranks reserve one CPU each in a `STRICT_PACK` placement group, so each node holds one
replica and both of its ranks. Checked: both nodes host a replica with its ranks packed; TP=2 answers equal
the demo models' (which the TP=1 cluster and single server give); an adapter registered after start
reaches both nodes through the database only (each replica's own cache dir); a layout the nodes cannot
hold and a second driver are refused with one line, leaving the running application alone; stopping the
worker node (what `ray stop` does there) fails its requests over to the head's replica; SIGTERM of
loraplex removes only its own Serve application (another one on the cluster keeps answering).

Both nodes run on this machine, so each is started with `ray start --block` and stopped by signalling that
process (with no drain wait: what `ray stop` does on a machine of its own; a plain `ray stop` here would
stop every Ray process on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.cluster.conftest import ADAPTERS, DEMO, EXPECTED
from tests.helpers.live_server import ADMIN_TOKEN, free_port, wait_until
from tests.helpers.redis_service import REDIS_URL, require_redis
from tests.lora_registry.pg import postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]
ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
TEXTS = ("hello world", "ray serve", "many lora")
BODY = {"max_tokens": 32, "temperature": 0, "stop": ["\n"]}
NODE_CPUS = 2  # logical CPUs of each Ray node: one replica of 2 ranks x 1 thread
RAY_TOKEN = secrets.token_hex(32)  # this module's cluster's token (Ray >= 2.5x authenticates every node)


@dataclass
class Process:
    """A process this module started (its own session, so that its children can be stopped with it),
    with its output collected line by line."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, cmd: list[str], env: dict[str, str]) -> Process:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        me = cls(proc)
        threading.Thread(target=lambda: me.lines.extend(proc.stdout or []), daemon=True).start()
        return me

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        ok = wait_until(lambda: text in self.output or self.proc.poll() is not None, timeout, 0.3)
        assert ok and text in self.output, self.output[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Signal the process, wait up to `timeout` s, then kill its whole session (it is ours)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its session is left
        if self.proc.poll() is None:
            self.proc.wait(10)
        return self.proc.returncode


@dataclass
class Nodes:
    gcs: str  # the head's address, host:port
    head: Process
    worker: Process
    cache: dict[str, Path]  # node name -> its LORAPLEX_REPLICA_DATA_DIR
    temp: dict[str, Path]  # node name -> its Ray --temp-dir (its sessions' logs)


def _node_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS") and k != "RAY_TMPDIR"}
    env.pop("LORAPLEX_REPLICA_DATA_DIR", None)
    return env | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "LORAPLEX_REPLICA_DATA_DIR": str(cache),  # what each node's replicas take (the runbook's step)
        "RAY_AUTH_MODE": "token",  # the same token on every node and the driver, not ~/.ray/auth_token
        "RAY_AUTH_TOKEN": RAY_TOKEN,
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # stopping a node is `ray stop`: no drain wait
        "RAY_USAGE_STATS_ENABLED": "0",
        # Serve's multiplexed-id matching on a loaded machine (as tests/api/cluster/conftest.py)
        "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": "10",
    }


def _ray_start(root: Path, name: str, *args: str) -> tuple[Process, Path]:
    cache = root / f"{name}-cache"
    cmd = [str(BIN / "ray"), "start", "--block", "--num-cpus", str(NODE_CPUS)]
    cmd += ["--temp-dir", str(root / name), "--disable-usage-stats"]
    cmd += ["--dashboard-agent-listen-port", str(free_port()), *args]
    node = Process.start(cmd, _node_env(cache))
    node.wait_for("Ray runtime started", timeout=180)
    return node, cache


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    root = Path(tempfile.mkdtemp(prefix="lpxmn-", dir="/tmp"))  # short: Ray's socket paths live under it
    gcs = f"127.0.0.1:{free_port()}"
    started: list[Process] = []
    try:
        head, head_cache = _ray_start(
            root,
            "head",
            "--head",
            "--port",
            gcs.rsplit(":", 1)[1],
            "--include-dashboard",
            "false",
            "--ray-client-server-port",
            str(free_port()),
        )
        started.append(head)
        worker, worker_cache = _ray_start(root, "worker", "--address", gcs)
        started.append(worker)
        caches = {"head": head_cache, "worker": worker_cache}
        yield Nodes(gcs, head, worker, caches, {"head": root / "head", "worker": root / "worker"})
    finally:
        for node in reversed(started):  # even after a failure: no Ray process of ours is left
            node.stop()
        subprocess.run(["rm", "-rf", str(root)], check=False)


@dataclass
class Served:
    url: str
    nodes: Nodes
    driver: Process
    env: dict[str, str]
    cmd: list[str]

    def replicas(self) -> list[dict]:
        r = httpx.get(f"{self.url}/admin/api/cluster", headers=_admin(), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["replicas"]

    def node_of(self, replica: dict) -> str:
        """`head` or `worker`: whose LORAPLEX_REPLICA_DATA_DIR the replica made its cache dir in."""
        (name,) = [n for n, d in self.nodes.cache.items() if Path(replica["data_dir"]).parent == d]
        return name


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def served(nodes: Nodes, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from api.settings import ServerSettings
    from lora_registry import open_registry
    from lora_registry.migrate import upgrade

    require_redis()
    data = tmp_path_factory.mktemp("driver")
    port = free_port()
    with postgres_database() as db_url:
        upgrade(db_url)
        env = {k: v for k, v in _node_env(data / "unused").items() if k != "LORAPLEX_REPLICA_DATA_DIR"}
        env |= {
            "LORAPLEX_DATA_DIR": str(data / "data"),
            "LORAPLEX_DATABASE_URL": db_url,
            "LORAPLEX_REDIS_URL": REDIS_URL,
            "LORAPLEX_BLOB_STORE": "database",
            "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN,
        }
        reg = open_registry(ServerSettings.build(str(DEMO / "base"), env=env).registry)
        try:
            for name in ADAPTERS:
                reg.adapters.register(name, DEMO / "adapters" / name, activate=True)
        finally:
            reg.close()
        cmd = [str(BIN / "loraplex"), "serve", "--model", str(DEMO / "base"), "--device", "cpu"]
        cmd += ["--dtype", "float32", "--threads", "2", "--tensor-parallel-size", "2"]
        cmd += ["--num-kv-blocks", "128", "--max-loras", "4", "--max-num-seqs", "2"]
        cmd += ["--max-seqs-per-client", "64", "--shutdown-grace", "2"]
        cmd += ["--ray-address", nodes.gcs]
        driver = Process.start([*cmd, "--port", str(port), "--replicas", "2"], env)
        try:
            driver.wait_for("cluster ready in", timeout=600)
            url = f"http://127.0.0.1:{port}"
            assert wait_until(lambda: _status(url) == 200, timeout=120), driver.output[-4000:]
            yield Served(url, nodes, driver, env, cmd)
        finally:
            driver.stop(timeout=120)


def _status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _complete(url: str, adapter: str | None, text: str, **body) -> httpx.Response:
    path = f"/v1/adapters/{adapter}/completions" if adapter else "/v1/completions"
    return httpx.post(url + path, json=BODY | {"prompt": f"{text}="} | body, timeout=120)


def _answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _rank_pids(engine_pid: int) -> list[int]:
    """The tensor-parallel worker ranks (`python -m engine.distributed`) an engine process started."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == engine_pid and b"engine.distributed" in cmd:
            pids.append(int(entry.name))
    return pids


def test_each_node_hosts_one_replica_with_both_its_ranks(served: Served) -> None:
    replicas = served.replicas()
    assert len(replicas) == 2
    assert sorted(served.node_of(r) for r in replicas) == ["head", "worker"]  # each node's own env
    assert len({r["node_id"] for r in replicas}) == 2
    for r in replicas:
        group = r["placement"]
        assert group["strategy"] == "STRICT_PACK", group
        assert group["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}], group  # one CPU per rank (2 threads / 2)
        assert group["nodes"] == [r["node_id"]] * 2, group  # both ranks' bundles on the replica's node
        assert len(_rank_pids(r["engine_pid"])) == 1, r  # rank 1 runs beside the engine (rank 0)
    assert "2 CPU, 0 GPU each, 2 ranks packed on one node" in served.driver.output


def test_tensor_parallel_answers_are_exact_on_both_nodes(served: Served) -> None:
    """Base model and every adapter, streamed and not, under concurrent load (so that both replicas
    serve); the answers are the demo models' (tests/api/cluster/test_ray_cluster.py asserts the same at
    TP=1)."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_name = json.loads(httpx.get(served.url + "/v1/models", timeout=30).text)["data"][0]["id"]

    def streamed(job: tuple[str | None, str]) -> None:
        adapter, text = job
        chunks = client.completions.create(
            model=adapter or model_name, prompt=f"{text}=", stream=True, **BODY
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == EXPECTED[adapter](text), job

    jobs = [(a, t) for a in (None, *ADAPTERS) for t in TEXTS]
    answered_by: set[str] = set()
    for _ in range(3):  # rounds until both replicas have answered (the router places by load)
        with ThreadPoolExecutor(6) as pool:
            plain = list(pool.map(lambda job: (job, _complete(served.url, *job)), jobs))
            list(pool.map(streamed, jobs[::2]))
        for (adapter, text), r in plain:
            assert _answer(r) == EXPECTED[adapter](text), (adapter, text)
            answered_by.add(r.headers["x-loraplex-replica"])
        if len(answered_by) == 2:
            break
    assert answered_by == {r["replica"] for r in served.replicas()}


def _zip(name: str, note: str) -> bytes:
    """The demo adapter `name` as an upload whose config carries `note` (new content, new digest)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        config = json.loads((DEMO / "adapters" / name / "adapter_config.json").read_text())
        z.writestr("adapter_config.json", json.dumps(config | {"loraplex_test_note": note}))
        z.write(DEMO / "adapters" / name / "adapter_model.safetensors", "adapter_model.safetensors")
    return buf.getvalue()


def test_an_adapter_registered_after_start_reaches_both_nodes_through_the_database(served: Served) -> None:
    files = {"file": ("late.zip", _zip("reverse", "multinode-late"), "application/zip")}
    r = httpx.post(
        served.url + "/admin/api/adapters",
        data={"name": "late", "activate": "true"},
        files=files,
        headers=_admin(),
        timeout=60,
    )
    assert r.status_code == 201, r.text
    assert wait_until(lambda: all("late" in x["active"] for x in served.replicas()), timeout=30)
    digest = served.replicas()[0]["active"]["late"]
    by: set[str] = set()
    for _ in range(4):  # concurrent rounds: the hot adapter spreads to the second replica
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _complete(served.url, "late", TEXTS[i % 3]), range(8)))
        for i, r in enumerate(answers):
            assert _answer(r) == EXPECTED["reverse"](TEXTS[i % 3])
            by.add(r.headers["x-loraplex-replica"])
        if len(by) == 2:
            break
    replicas = served.replicas()
    assert by == {x["replica"] for x in replicas}, by
    for x in replicas:  # each node's replica read it from its own cache dir, filled from the database
        own = Path(x["data_dir"])
        assert own.parent == served.nodes.cache[served.node_of(x)]
        assert Path(x["loaded_paths"][digest]).is_relative_to(own), x["loaded_paths"]


def test_a_layout_that_does_not_fit_and_a_second_driver_are_refused(served: Served) -> None:
    """Two more drivers on the same cluster: 3 replicas of 2 ranks cannot fit on 2 nodes of 2 CPUs (a
    one-line error before anything is deployed), and one that would fit is refused because loraplex
    already runs there; the running application keeps answering."""
    for replicas, message in (
        ("3", "the Ray cluster can place 2 of the 3 engine replica(s): each needs 2 CPU on one node"),
        ("1", "a loraplex application is already running on the Ray cluster"),
    ):
        extra = ["--port", str(free_port()), "--replicas", replicas]
        cmd = [*served.cmd, *extra]
        done = subprocess.run(cmd, env=served.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stderr[-3000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert _answer(_complete(served.url, "upper", "still")) == EXPECTED["upper"]("still")
    assert len(served.replicas()) == 2


def test_stopping_the_worker_node_fails_over_to_the_head(served: Served) -> None:
    """Requests in flight on the worker node's replica when the node stops end correctly (those with no
    token yet are retried on the head's replica) or with the retryable 503; none hangs; every request
    afterwards is answered exactly by the head's replica, and the front end (on the head) stays up."""
    by_node = {served.node_of(r): r for r in served.replicas()}
    head, lost = by_node["head"]["replica"], by_node["worker"]["replica"]
    body = {"max_tokens": 40, "stop": [], "ignore_eos": True}  # long enough to be running at the stop
    jobs = [(a, t) for a in (None, *ADAPTERS) for t in TEXTS] * 2

    def run(job: tuple[str | None, str]) -> tuple[str | None, str, httpx.Response]:
        return (*job, _complete(served.url, *job, **body))

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        # more than its running batch (--max-num-seqs 2): some wait in its engine with no token yet
        busy = wait_until(lambda: in_flight(served, lost) >= 4, timeout=90, interval=0.2)
        served.nodes.worker.stop()  # its raylet and every worker process on it end (as with `ray stop`)
        results = [f.result(timeout=180) for f in futures]  # none hangs
    assert busy, "the worker node's replica never had requests waiting: nothing was tested"
    outcomes = {"ok": 0, "503": 0}
    for adapter, text, r in results:
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"].startswith(EXPECTED[adapter](text)), (adapter, text)
            outcomes["ok"] += 1
        else:
            assert r.status_code == 503 and "retry" in r.json()["error"]["message"], r.text
            outcomes["503"] += 1
    # the ingress (on the head node) retried the lost replica's requests that had no token yet
    logs = served.nodes.temp["head"] / "session_latest" / "logs"
    text = "\n".join(f.read_text(errors="replace") for f in logs.glob("worker-*.err"))
    retried = text.count(f"replica {lost} failed before the first token")
    print(f"worker node stopped with requests in flight: {outcomes}, {retried} retried on the head")
    assert retried >= 1, "no request of the lost replica was retried"
    assert outcomes["ok"] >= retried
    assert _status(served.url) == 200  # the ingress runs on the head node
    after = [(a, t) for a in (None, *ADAPTERS) for t in TEXTS]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: (job, _complete(served.url, *job)), after))
    for (adapter, text), r in answers:
        assert _answer(r) == EXPECTED[adapter](text), (adapter, text)
        assert r.headers["x-loraplex-replica"] == head
    healthy = [r["replica"] for r in served.replicas() if r["healthy"]]
    assert healthy == [head], healthy  # the replacement cannot be placed: the head's CPUs are taken


def in_flight(served: Served, replica: str) -> int:
    try:
        return next((r["in_flight"] for r in served.replicas() if r["replica"] == replica), 0)
    except (httpx.HTTPError, AssertionError):
        return 0


BYSTANDER = """
import ray
from ray import serve

ray.init(address={gcs!r}, namespace="bystander")


@serve.deployment(num_replicas=1, ray_actor_options={{"num_cpus": 0}})
class Bystander:
    def __call__(self, request) -> str:
        return "still here"


serve.run(Bystander.bind(), name="bystander", route_prefix="/bystander")
"""


def test_sigterm_removes_only_loraplex_from_the_shared_cluster(served: Served) -> None:
    """Another team's Serve application on the same cluster keeps answering through Serve's proxy after
    loraplex's driver drained and exited on SIGTERM; loraplex's routes are gone. Runs last."""
    script = BYSTANDER.format(gcs=served.nodes.gcs)
    env = served.env | {"RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": "10"}
    cmd = [sys.executable, "-c", script]
    deployed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert httpx.get(served.url + "/bystander", timeout=30).text == "still here"
    code = served.driver.stop(timeout=120)
    assert code == 0, served.driver.output[-4000:]
    out = served.driver.output
    assert "draining:" in out and "loraplex stopped" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert httpx.get(served.url + "/bystander", timeout=30).text == "still here"
    assert httpx.get(served.url + "/v1/models", timeout=30).status_code == 404
