"""`loraplex serve --prefill-replicas 1 --decode-replicas 1` on a local Ray cluster (the demo model, 4-token
KV blocks so prompts span 1 to several blocks): answers equal the colocated server's (`EXPECTED`, which the
`--replicas` tests check) for the base model and mixed adapters, streaming and not (a 3-token prompt, at
`--local-prefill-tokens`, served whole by the decode replica, with no KV handoff); the prefill side hits
its prefix cache; the decode replica loads each adapter during the prefill, never after; KV-transfer
metrics (the prefill replica drops a handoff's chunk refs at the decode side's ack; no staged KV file
stays in /dev/shm); a transfer that stalls (the decode engine stopped) is cancelled past
`--kv-transfer-timeout` and leaves no block held on either side; the decode replica dying mid-stream
ends the stream cleanly, leaves no block held, and answers are right again once Serve has replaced it;
the prefill replica dying mid-prefill is retried or answered with the retryable 503, never a hang."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.cluster import ray_api
from api.cluster.disaggregated.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT
from api.engine_protocol import EngineStatsMsg, decode_from_engine
from engine.kv_transfer.shm_stage import PREFIX, SHM_DIR
from tests.api.cluster.conftest import ADAPTERS, EXPECTED, Cluster, running_cluster
from tests.helpers.live_server import wait_until

pytestmark = pytest.mark.slow
TEXTS = ("a", "hello world", "prefill and decode")  # 3, 13 and 20 prompt tokens: 1, 4 and 5 blocks
LOCAL = 3  # the cluster's --local-prefill-tokens: "a=" runs whole on the decode replica, no KV handoff
BODY = {"max_tokens": 32, "temperature": 0, "stop": ["\n"]}
TIMEOUT = 10.0  # the cluster's --kv-transfer-timeout: long enough for a transfer on a busy 2-core machine


def replica_staged_files() -> set[str]:
    """The KV files staged in /dev/shm by this module's cluster (or by killed replicas of earlier runs),
    not by the other pytest workers or the engines they start (with `-n 2` their connector tests stage and
    remove files of their own meanwhile)."""
    others = _other_workers_and_their_children()
    return {
        f
        for f in glob.glob(f"{SHM_DIR}/{PREFIX}*")
        if os.path.basename(f).removeprefix(PREFIX).split("-", 1)[0] not in others
    }


def _other_workers_and_their_children() -> set[str]:
    """The pids of this process, of the other xdist workers (its siblings) and of their descendants; this
    process's own descendants (the Ray cluster's replicas) are not in it."""
    parents: dict[str, str] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[stat.split("/")[2]] = fields[1]  # field 4 of /proc/PID/stat, after "pid (comm)": the parent
    me, parent = str(os.getpid()), str(os.getppid())
    roots = {pid for pid, ppid in parents.items() if ppid == parent and pid != me}
    out = {me}
    for pid in parents:
        p, seen = pid, 0
        while p in parents and seen < 64:
            if p in roots:
                out.add(pid)
                break
            p, seen = parents[p], seen + 1
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    engine = {"block_size": 4}
    layout = dict(
        replicas=0,
        prefill_replicas=1,
        decode_replicas=1,
        kv_transfer_timeout_s=TIMEOUT,
        local_prefill_tokens=LOCAL,
    )
    with running_cluster(tmp_path_factory, engine, **layout) as c:
        yield c


def _describe(deployment: str) -> list[dict]:
    handle = ray_api.deployment_handle(deployment)
    return [r for r in ray_api.broadcast_sync(handle, "describe", 10.0) if isinstance(r, dict)]


def _engine_stats(r: dict) -> dict:
    stats = decode_from_engine(r["stats"])
    assert isinstance(stats, EngineStatsMsg)
    return stats.engine


def _idle(deployment: str) -> bool:
    """Every replica of `deployment` reports no KV block in use and nothing queued or running."""
    reps = _describe(deployment)
    return bool(reps) and all(
        r["stats"] and _engine_stats(r)["kv_blocks_used"] == 0 and _engine_stats(r)["num_running"] == 0
        for r in reps
    )


def _stream(url: str, adapter: str | None, text: str, **extra) -> tuple[int, str, bool]:
    """(status, text, ended with an error event) of one streamed completion."""
    path = f"/v1/adapters/{adapter}/completions" if adapter else "/v1/completions"
    body = BODY | {"prompt": f"{text}=", "stream": True} | extra
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, False
        out, error = "", False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"].get("message", True)
            elif event["choices"]:
                out += event["choices"][0]["text"]
        return 200, out, error


def test_answers_equal_colocated_streaming_and_not(cluster: Cluster) -> None:
    [pre0] = _describe(PREFILL_DEPLOYMENT)
    [dec0] = _describe(DECODE_DEPLOYMENT)
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    jobs = [(adapter, text) for text in TEXTS for adapter in (None, *ADAPTERS)]

    def run(job):
        adapter, text = job
        model = adapter or cluster.settings.served_model_name
        out = client.completions.create(model=model, prompt=f"{text}=", **BODY).choices[0].text
        return out, _stream(cluster.url, adapter, text)

    with ThreadPoolExecutor(3) as pool:  # mixed adapters in flight at once
        results = list(pool.map(run, jobs))
    for (adapter, text), (plain, streamed) in zip(jobs, results, strict=True):
        want = EXPECTED[adapter](text)
        assert plain == want, (adapter, text)
        assert streamed == (200, want, False), (adapter, text)
    r = httpx.post(cluster.url + "/v1/adapters/upper/completions", json=BODY | {"prompt": "hello world="})
    served_by = r.headers["x-loraplex-replica"].split(",")
    assert len(served_by) == 2, served_by  # a prefill and a decode replica
    [dec] = _describe(DECODE_DEPLOYMENT)
    r = httpx.post(cluster.url + "/v1/adapters/upper/completions", json=BODY | {"prompt": "a="})
    assert r.json()["choices"][0]["text"] == EXPECTED["upper"]("a")
    assert r.headers["x-loraplex-replica"].split(",") == [dec["replica"]]  # a short prompt: decode only
    assert wait_until(lambda: _idle(PREFILL_DEPLOYMENT) and _idle(DECODE_DEPLOYMENT), timeout=10)
    [pre] = _describe(PREFILL_DEPLOYMENT)
    [dec] = _describe(DECODE_DEPLOYMENT)
    handed = [job for job in jobs if job[1] != "a"]  # prompts over LOCAL tokens
    n = 2 * len(handed) + 1
    assert pre["kv_exports"] - pre0["kv_exports"] == dec["kv_imports"] - dec0["kv_imports"] == n, (pre, dec)
    # every adapter was made resident by `prepare`, started with the prefill: no decode loaded one after,
    # nor asked its engine again (its step loop would answer between steps, stalling the running streams)
    assert dec["prepared"] - dec0["prepared"] == n and dec["late_loads"] == 0, dec
    assert dec["decode_adds"] == 0, dec
    assert _engine_stats(pre)["prefix_cache_hits"] > 0  # each prompt ran twice: the second hit
    missing = httpx.post(cluster.url + "/v1/completions", json=BODY | {"model": "nope", "prompt": "a="})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _metric(cluster: Cluster, name: str, **labels: str) -> float:
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_kv_transfer_metrics(cluster: Cluster) -> None:
    staged = replica_staged_files()  # left by other runs' killed replicas, if any
    httpx.post(
        cluster.url + "/v1/adapters/rot13/completions", json=BODY | {"prompt": "ray serve="}, timeout=60
    )
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("loraplex_kv_transfers_total", (("outcome", "ok"),))] >= 1
    assert samples[("loraplex_kv_transfer_bytes_total", ())] > 0
    assert samples[("loraplex_kv_transfer_seconds_count", ())] >= 1
    assert ("loraplex_disaggregated_requests", (("phase", "decode"),)) in samples
    assert ("loraplex_phase_requests_waiting", (("phase", "prefill"),)) in samples
    # the admin API lists both deployments' replicas with their roles and transfer counters
    by_role = {r["role"]: r for r in cluster.replicas()}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["prefill"]["kv_exports"] >= 1 and by_role["decode"]["kv_imports"] >= 1
    assert by_role["decode"]["late_loads"] == 0 and "kv_timeouts" in by_role["decode"]
    # the prefill replica dropped the handoff's chunk refs at the decode side's ack, well before the
    # transfer timeout that bounds them otherwise; the decode replica removed its staged file
    assert wait_until(lambda: _describe(PREFILL_DEPLOYMENT)[0]["kv_held"] == 0, timeout=TIMEOUT / 2)
    assert replica_staged_files() <= staged


def test_stalled_transfer_is_cancelled_and_releases_everything(cluster: Cluster) -> None:
    """The decode engine is stopped (SIGSTOP), so it never acknowledges the import of the blocks its
    replica fetched: past the transfer timeout the transfer is cancelled and the stream, which had its
    first token from the prefill, ends with an error event (no hang; counted as a timeout), and the
    replica removes the staged blocks' file. Once the engine runs again it reads the import (refused:
    its file is gone), then the abort: both pools are empty, on the same replicas
    (nothing was replaced), which answer correctly again."""
    [pre] = _describe(PREFILL_DEPLOYMENT)
    [dec] = _describe(DECODE_DEPLOYMENT)
    timeouts = _metric(cluster, "loraplex_kv_transfers_total", outcome="timeout")
    staged = replica_staged_files()  # left by other runs' killed replicas, if any
    os.kill(dec["engine_pid"], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status, text, error = _stream(cluster.url, None, "hello world")
        elapsed = time.monotonic() - t0
    finally:
        os.kill(dec["engine_pid"], signal.SIGCONT)
    assert status == 200 and error, (status, text, error)
    assert "did not complete within" in str(error), error
    assert text == EXPECTED[None]("hello world")[0]  # the prefill's first token, then the error
    assert TIMEOUT <= elapsed < TIMEOUT + 20
    assert _metric(cluster, "loraplex_kv_transfers_total", outcome="timeout") == timeouts + 1

    def released() -> bool:  # the engine reads the import and the abort before the requests below
        return (
            _idle(PREFILL_DEPLOYMENT)
            and _idle(DECODE_DEPLOYMENT)
            and replica_staged_files() <= staged  # the replica removed its staged file
        )

    assert wait_until(released, timeout=30)
    [after] = _describe(DECODE_DEPLOYMENT)
    assert after["replica"] == dec["replica"] and after["kv_timeouts"] == dec["kv_timeouts"] + 1
    assert _describe(PREFILL_DEPLOYMENT)[0]["replica"] == pre["replica"]
    for adapter in (None, "upper"):
        assert _stream(cluster.url, adapter, "hello world") == (200, EXPECTED[adapter]("hello world"), False)
    assert wait_until(lambda: _idle(PREFILL_DEPLOYMENT) and _idle(DECODE_DEPLOYMENT), timeout=10)


def test_decode_replica_dying_mid_stream(cluster: Cluster) -> None:
    """The decode engine is stopped (SIGSTOP) so the request is mid-stream for sure: the first token came
    from the prefill, the decode replica took the KV (a base-model request: preparing it needs no engine
    call), the rest never comes; then the decode replica is killed. The stream ends with an
    error event (no hang), the prefill side holds no block, and once Serve has replaced the decode
    replica the answers are right and its pool is empty again."""
    [dec] = _describe(DECODE_DEPLOYMENT)
    [name] = ray_api.replica_actor_names(DECODE_DEPLOYMENT)
    staged = replica_staged_files()
    os.kill(dec["engine_pid"], signal.SIGSTOP)
    try:
        fetched = dec["kv_imports"]
        body = BODY | {"prompt": "hello world=", "stream": True, "model": cluster.settings.served_model_name}
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] == EXPECTED[None]("hello world")[0]
            took = lambda: _describe(DECODE_DEPLOYMENT)[0]["kv_imports"] > fetched
            assert wait_until(took, timeout=20)  # the decode replica holds the KV (its engine: stopped)
            t0 = time.monotonic()
            ray_api.kill_actor(name)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert time.monotonic() - t0 < 30
        assert any("error" in e for e in rest), [(e.get("choices"), e.get("error")) for e in rest]
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped, then orphaned by its replica
            os.kill(dec["engine_pid"], signal.SIGKILL)
    assert _idle(PREFILL_DEPLOYMENT)  # its blocks were freed at the export

    def replaced() -> bool:
        try:
            reps = _describe(DECODE_DEPLOYMENT)
        except Exception:
            return False
        return bool(reps) and all(r["replica"] != dec["replica"] and r["healthy"] for r in reps)

    assert wait_until(replaced, timeout=120, interval=0.5)
    assert replica_staged_files() <= staged  # the new replica swept the dead one's file
    assert wait_until(lambda: httpx.get(cluster.url + "/ready", timeout=5).status_code == 200, timeout=60)
    for adapter in (None, *ADAPTERS):
        assert _stream(cluster.url, adapter, "hello world") == (200, EXPECTED[adapter]("hello world"), False)
    assert wait_until(lambda: _idle(PREFILL_DEPLOYMENT) and _idle(DECODE_DEPLOYMENT), timeout=10)


def test_prefill_replica_dying_mid_prefill(cluster: Cluster) -> None:
    """The prefill engine is stopped, so the request is mid-prefill (no token yet); the prefill replica is
    killed. The request is retried once (on the replica Serve starts instead): it answers correctly or
    with the retryable 503, never hangs; nothing stays held on the decode side."""
    [pre] = _describe(PREFILL_DEPLOYMENT)
    [name] = ray_api.replica_actor_names(PREFILL_DEPLOYMENT)
    os.kill(pre["engine_pid"], signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            body = BODY | {"prompt": "hello world="}
            fut = pool.submit(
                httpx.post, cluster.url + "/v1/adapters/upper/completions", json=body, timeout=150
            )
            time.sleep(1.0)
            ray_api.kill_actor(name)
            r = fut.result(timeout=160)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pre["engine_pid"], signal.SIGKILL)
    if r.status_code == 200:
        assert r.json()["choices"][0]["text"] == EXPECTED["upper"]("hello world")
    else:
        assert r.status_code == 503, r.text
    assert wait_until(lambda: _idle(DECODE_DEPLOYMENT), timeout=20)
    assert _stream(cluster.url, "rot13", "hello world") == (200, EXPECTED["rot13"]("hello world"), False)
