"""`loraplex serve --replicas 2` on a local Ray cluster: a local cluster despite a stale Ray address, a
start-up without ingress crashes, exact answers, adapter affinity, registry consistency across replicas,
replicas with their own blob caches, per-replica metrics and admin pool page, shared prefixes routed to
the replica holding them (the default affinity router), failover when an engine process or a replica
dies."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.cluster import ray_api
from api.cluster.deployments import ENGINE_DEPLOYMENT
from tests.api.cluster.conftest import ADAPTERS, DEAD_RAY_ADDRESS, DEMO, EXPECTED, Cluster
from tests.helpers.live_server import wait_until

pytestmark = pytest.mark.slow
TEXTS = ("hello world", "ray serve", "many lora")
BODY = {"max_tokens": 32, "temperature": 0, "stop": ["\n"]}


def _complete(
    url: str, adapter: str | None, text: str, timeout: float = 60, max_tokens: int = 32
) -> httpx.Response:
    path = f"/v1/adapters/{adapter}/completions" if adapter else "/v1/completions"
    body = BODY | {"prompt": f"{text}=", "max_tokens": max_tokens}
    return httpx.post(url + path, json=body, timeout=timeout)


def test_a_plain_start_is_a_new_local_cluster_despite_a_stale_address(cluster: Cluster) -> None:
    """The fixture started with `RAY_ADDRESS` and Ray's address file naming a dead cluster."""
    assert ray_api.gcs_address() != DEAD_RAY_ADDRESS
    assert list((cluster.ray_tmp / "ray").glob("session_*")), "the new cluster's session is not local"
    r = _complete(cluster.url, None, "hello world")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == EXPECTED[None]("hello world")


def test_start_up_has_no_ingress_crash_and_reports_its_phases(cluster: Cluster) -> None:
    logs = cluster.ray_logs()
    assert any(name.startswith("serve/controller") for name in logs), sorted(logs)
    for name, text in logs.items():
        for crash in ("DeploymentUnavailableError", "Exception in Replica", "failed to initialize"):
            assert crash not in text, (name, crash)
    assert set(cluster.startup) == {"registry", "ray", "serve", "deploy", "total"}
    assert cluster.startup["total"] >= cluster.startup["deploy"] > 0
    text = "\n".join(logs.values())
    ready = re.findall(r"replica (\S+) ready in [\d.]+ s: registry [\d.]+ s, engine [\d.]+ s", text)
    assert len(set(ready)) >= 2, "each engine replica logs its start-up phases"
    assert "engine replicas ready after" in text  # the ingress waited for them instead of failing
    for r in cluster.replicas():
        assert set(r["startup_seconds"]) == {"registry", "engine", "follower", "total"}


def test_every_answer_exact_streaming_and_not(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    for adapter in (None, *ADAPTERS):
        model = adapter or cluster.settings.served_model_name
        for text in TEXTS:
            want = EXPECTED[adapter](text)
            out = client.completions.create(model=model, prompt=f"{text}=", **BODY)
            assert out.choices[0].text == want, (adapter, text)
            chunks = client.completions.create(model=model, prompt=f"{text}=", stream=True, **BODY)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want, (adapter, text)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello world="}], max_tokens=32, temperature=0
        )
        assert chat.choices[0].message.content is not None
    missing = httpx.post(cluster.url + "/v1/completions", json=BODY | {"model": "nope", "prompt": "a="})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_affinity_requests_go_to_replicas_that_hold_their_adapter(cluster: Cluster) -> None:
    """Under concurrent traffic every request reaches a replica that already held its adapter on the
    device, and no adapter is loaded again (no ping-pong). An adapter an earlier test made resident on
    both replicas may be served by either."""
    _warm_up_until_routing_is_stable(cluster)
    before = cluster.replicas()
    assert len(before) == 2
    holders = {
        name: {r["replica"] for r in before if any(_on_device(a, name) for a in r["adapters"])}
        for name in ADAPTERS
    }
    assert all(holders.values()), holders
    jobs = [(name, text) for name in ADAPTERS for text in TEXTS * 3]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda job: (job[0], _complete(cluster.url, *job)), jobs))
    for name, r in answers:
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-replica"] in holders[name], (
            name,
            r.headers["x-loraplex-replica"],
            holders,
        )
    # no ping-pong: nothing was loaded again while the traffic ran
    assert sum(r["lora"]["loads"] for r in cluster.replicas()) == sum(r["lora"]["loads"] for r in before)


def _on_device(adapter: dict, name: str) -> bool:
    return name in adapter["names"] and adapter["tier"] == "device"


def _warm_up_until_routing_is_stable(cluster: Cluster, timeout: float = 60.0) -> None:
    """One request per adapter, one after the other, in rounds until two rounds in a row reach the same
    replica per adapter: replicas report their multiplexed ids to Serve's routers asynchronously, which
    takes longer on a busy machine than any fixed sleep would allow for."""
    previous: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        placed = {}
        for name in ADAPTERS:
            r = _complete(cluster.url, name, "warm up")
            assert r.status_code == 200, r.text
            placed[name] = r.headers["x-loraplex-replica"]
        if placed == previous:
            return
        previous = placed
        time.sleep(0.5)
    raise AssertionError(f"routing did not settle in {timeout} s: {previous}")


def _zip(name: str, note: str | None = None) -> bytes:
    """The demo adapter `name` as an upload; with `note`, its config carries it (new content, new digest,
    same weights)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if note is not None and f == "adapter_config.json":
                config = json.loads((DEMO / "adapters" / name / f).read_text())
                z.writestr(f, json.dumps(config | {"loraplex_test_note": note}))
            else:
                z.write(DEMO / "adapters" / name / f, f)
    return buf.getvalue()


def _follow(cluster: Cluster, name: str, active: bool, since: float) -> float:
    """Seconds from `since` (wall clock, when the admin call returned) until the last replica's registry view
    changed `name` to active (or not), as the replicas timed it themselves: the time spent polling them
    through Ray afterwards is not part of the propagation."""
    replicas: list[dict] = []

    def changed() -> bool:
        replicas[:] = cluster.replicas()
        return all((name in r["active"]) == active for r in replicas)

    assert wait_until(changed, 5, 0.05), replicas
    return max(r["changed_at"][name] for r in replicas) - since


def test_registry_changes_reach_every_replica_within_a_second(cluster: Cluster) -> None:
    with cluster.admin() as admin:
        files = {"file": ("shout.zip", _zip("upper"), "application/zip")}
        r = admin.post("/admin/api/adapters", data={"name": "shout", "activate": "true"}, files=files)
        assert r.status_code == 201, r.text
        assert _follow(cluster, "shout", True, time.time()) < 1.0
        assert _complete(cluster.url, "shout", "hello world").json()["choices"][0]["text"] == "HELLO WORLD"
        assert admin.post("/admin/api/adapters/shout/deactivate").status_code == 200
        assert _follow(cluster, "shout", False, time.time()) < 1.0
        assert _complete(cluster.url, "shout", "hello world").status_code == 404
        assert admin.post("/admin/api/adapters/shout/activate").status_code == 200
        assert _follow(cluster, "shout", True, time.time()) < 1.0
        assert _complete(cluster.url, "shout", "ray serve").json()["choices"][0]["text"] == "RAY SERVE"
        assert admin.delete("/admin/api/adapters/shout").status_code == 200
        assert _follow(cluster, "shout", False, time.time()) < 1.0


def test_replicas_keep_their_own_blob_caches(cluster: Cluster) -> None:
    """Each replica loads adapters from a cache dir of its own (the database is the only way weights reach
    it): an adapter registered after start-up, with content no replica has seen, is served from there,
    never from the driver's data dir."""
    with cluster.admin() as admin:
        files = {"file": ("late.zip", _zip("reverse", note="late"), "application/zip")}
        r = admin.post("/admin/api/adapters", data={"name": "late", "activate": "true"}, files=files)
        assert r.status_code == 201, r.text
        assert _follow(cluster, "late", True, time.time()) < 1.0
    digest = next(r["active"]["late"] for r in cluster.replicas())
    assert all(digest not in r["loaded_paths"] for r in cluster.replicas())
    for text in TEXTS:
        r = _complete(cluster.url, "late", text)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == EXPECTED["reverse"](text)
    replicas = cluster.replicas()
    dirs = [Path(r["data_dir"]) for r in replicas]
    assert len(set(dirs)) == len(replicas) == 2
    driver_dir = cluster.settings.registry.data_dir
    for r, own in zip(replicas, dirs, strict=True):
        assert own.parent == cluster.replica_dirs and own.is_dir()
        assert r["loaded_paths"], r["replica"]
        for path in r["loaded_paths"].values():
            assert Path(path).is_relative_to(own), (r["replica"], path)
            assert not Path(path).is_relative_to(driver_dir)
    assert any(digest in r["loaded_paths"] for r in replicas), "no replica loaded the late adapter"


def _stream(url: str, adapter: str, text: str) -> tuple[int, str, bool]:
    """(status, text, ended with an error event) of one streamed completion."""
    body = BODY | {"prompt": f"{text}=", "stream": True}
    with httpx.stream("POST", f"{url}/v1/adapters/{adapter}/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, False
        text_out, error = "", False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = True
            elif event["choices"]:
                text_out += event["choices"][0]["text"]
        return 200, text_out, error


def test_metrics_carry_the_gateway_gauges_per_replica(cluster: Cluster) -> None:
    served = _complete(cluster.url, "rot13", "hello world")
    assert served.status_code == 200
    time.sleep(1.0)  # the ingress polls the replicas twice a second
    replicas = {r["replica"] for r in cluster.replicas()}
    assert len(replicas) == 2
    text = httpx.get(cluster.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
        assert sorted(s.labels["replica"] for s in families[name].samples) == sorted(replicas), name
    info = families["vllm:lora_requests_info"].samples
    assert sorted(s.labels["replica"] for s in info) == sorted(replicas)
    for s in info:
        assert set(s.labels) == {
            "replica",
            "max_lora",
            "running_lora_adapters",
            "waiting_lora_adapters",
            "model_name",
        }
        assert s.labels["max_lora"] == "4"  # each replica's own, not a sum
    resident = families["loraplex_lora_adapter_resident"].samples
    assert all(set(s.labels) == {"replica", "adapter", "digest", "tier", "pinned"} for s in resident)
    holder = served.headers["x-loraplex-replica"]
    assert any(
        s.labels["replica"] == holder
        and s.labels["adapter"] == "rot13"
        and s.labels["tier"] in ("device", "cpu")
        for s in resident
    )
    assert "loraplex_requests_total" in text  # the ingress's own counters beside them


def test_admin_pool_shows_each_replicas_own_pool(cluster: Cluster) -> None:
    """`GET /admin/api/pool` lists every replica's pool from the reports its gauges come from; the page
    `/admin/pool` in a real Chromium shows one section per replica, the adapter on the one that served."""
    from tests.admin_ui.browser import chromium_page, log_in
    from tests.helpers.live_server import ADMIN_TOKEN

    served = _complete(cluster.url, "novowels", "hello world")
    assert served.status_code == 200
    holder = served.headers["x-loraplex-replica"]
    time.sleep(1.0)  # the ingress polls the replicas twice a second
    replicas = {r["replica"] for r in cluster.replicas()}
    with cluster.admin() as c:
        pool = c.get("/admin/api/pool").json()
    per = {p["replica"]: p for p in pool["replicas"]}
    assert set(per) == replicas and len(per) == 2
    for p in per.values():
        assert p["healthy"] is True
        assert p["kv_blocks_total"] == 128  # each replica's own cache, not the sum
        assert p["lora"]["pages_total"] > 0 and p["num_waiting"] >= 0 and p["num_running"] >= 0
    assert pool["engine"]["kv_blocks_total"] == sum(p["kv_blocks_total"] for p in per.values())
    held = [a for a in per[holder]["adapters"] if a["active_name"] == "novowels"]
    assert held and held[0]["tier"] in ("device", "cpu"), per[holder]["adapters"]
    with chromium_page(cluster.url) as page:
        log_in(page, ADMIN_TOKEN, "/admin/pool")
        sections = page.locator("section[data-replica]")
        assert sorted(sections.evaluate_all("els => els.map(e => e.dataset.replica)")) == sorted(replicas)
        mine = page.locator(f'section[data-replica="{holder}"]')
        assert mine.locator('tr[data-adapter="novowels"]').count() == 1
        assert "128 blocks" in mine.locator('[data-field="kv_usage"]').inner_text()


def _prefix_hits(cluster: Cluster) -> dict[str, int]:
    return {r["replica"]: r["prefix_cache"]["hits"] for r in cluster.replicas()}


def _predicted(cluster: Cluster) -> float:
    """Prompt tokens the router predicted cached on the replicas it chose, so far."""
    m = cluster.router_metrics()
    return sum(v for (name, _), v in m.items() if name == "loraplex_router_predicted_cached_tokens_total")


def test_shared_prefix_requests_go_to_the_replica_holding_the_prefix(cluster: Cluster) -> None:
    """The default router (`--router affinity`): requests that share a prefix (base model, and an adapter
    with another prefix) all reach the replica that served the first of them, and that replica's prefix
    cache hits grow by at least one block per request."""
    block = cluster.settings.engine.block_size
    for adapter, prefix in (
        (None, "system prompt shared by all base "),
        ("rot13", "another prefix for rot13 ok "),
    ):
        before = _prefix_hits(cluster)
        first = _complete(cluster.url, adapter, prefix + "first", max_tokens=4)
        assert first.status_code == 200, first.text
        holder = first.headers["x-loraplex-replica"]
        # the holder reports the prefix's blocks itself (its engine's cache), beyond the router's guess
        held = {r["replica"]: r["prefix_blocks_held"] for r in cluster.replicas()}
        assert held[holder] >= len(prefix) // block, held
        predicted = _predicted(cluster)
        placed = []
        for i in range(6):
            r = _complete(cluster.url, adapter, f"{prefix}q{i} ask", max_tokens=4)
            assert r.status_code == 200, r.text
            placed.append(r.headers["x-loraplex-replica"])
        assert placed == [holder] * 6, (adapter, holder, placed)
        assert _predicted(cluster) >= predicted + 6 * block  # each predicted its shared blocks
        want = before[holder] + 6 * block
        grew = wait_until(lambda h=holder, w=want: _prefix_hits(cluster)[h] >= w, timeout=10)
        assert grew, (adapter, before, _prefix_hits(cluster))


def _prefix_totals(cluster: Cluster) -> tuple[int, int]:
    """(prompt tokens looked up, of which hit) over every replica's prefix cache."""
    rs = cluster.replicas()
    return sum(r["prefix_cache"]["queries"] for r in rs), sum(r["prefix_cache"]["hits"] for r in rs)


def test_a_re_registered_name_gets_no_hit_on_its_old_blocks(cluster: Cluster) -> None:
    """Delete an adapter and register its name again with other weights: the same prompt gets no served
    prefix hit on the blocks the old weights computed (the router and the engine key blocks by content
    digest, not by name), and answers with the new weights."""
    text, block = "swapping lora weights", cluster.settings.engine.block_size
    with cluster.admin() as admin:
        files = {"file": ("swap.zip", _zip("rot13", note="swap-v1"), "application/zip")}
        assert admin.post(
            "/admin/api/adapters", data={"name": "swap", "activate": "true"}, files=files
        ).is_success
        _follow(cluster, "swap", True, time.time())
        for _ in range(2):  # the second one hits the blocks the first cached
            r = _complete(cluster.url, "swap", text)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == EXPECTED["rot13"](text)
        assert admin.delete("/admin/api/adapters/swap").status_code == 200
        _follow(cluster, "swap", False, time.time())
        files = {"file": ("swap.zip", _zip("reverse", note="swap-v2"), "application/zip")}
        assert admin.post(
            "/admin/api/adapters", data={"name": "swap", "activate": "true"}, files=files
        ).is_success
        _follow(cluster, "swap", True, time.time())
    time.sleep(1.0)  # the replicas' stats of the requests above
    queries, hits = _prefix_totals(cluster)
    predicted = _predicted(cluster)
    r = _complete(cluster.url, "swap", text)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == EXPECTED["reverse"](text)
    assert _predicted(cluster) == predicted, "the router predicted a hit on the old weights' blocks"
    assert wait_until(lambda: _prefix_totals(cluster)[0] > queries, timeout=10)  # its lookup is counted
    assert _prefix_totals(cluster)[1] == hits, "a hit on blocks the old weights computed"
    again = _complete(cluster.url, "swap", text)  # the new weights' own blocks do hit
    assert again.headers["x-loraplex-replica"] == r.headers["x-loraplex-replica"]
    assert wait_until(lambda: _prefix_totals(cluster)[1] >= hits + block, timeout=10)


def test_failover_when_an_engine_process_is_killed(cluster: Cluster) -> None:
    """kill -9 one replica's engine: every request sent afterwards (none has a token yet) is retried on the
    other replica and answers exactly, none hangs, and Serve replaces the replica within seconds."""
    _warm_up_until_routing_is_stable(cluster)
    before = cluster.replicas()
    assert len(before) == 2 and all(r["engine_pid"] for r in before)
    victim = next(r for r in before if any(_on_device(a, n) for a in r["adapters"] for n in ADAPTERS))
    os.kill(victim["engine_pid"], signal.SIGKILL)
    killed = time.monotonic()
    jobs = [
        (adapter, text, i % 2 == 0)
        for i, (adapter, text) in enumerate((a, t) for a in (None, *ADAPTERS) for t in TEXTS)
    ]

    def run(job):
        adapter, text, stream = job
        if stream and adapter is not None:
            return job, _stream(cluster.url, adapter, text)
        r = _complete(cluster.url, adapter, text)
        got = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        return job, (r.status_code, got, False)

    with ThreadPoolExecutor(4) as pool:
        results = [f.result(timeout=90) for f in [pool.submit(run, job) for job in jobs]]  # none hangs
    for (adapter, text, _), (status, got, error) in results:
        assert status == 200 and not error and got == EXPECTED[adapter](text), (adapter, text, status, got)

    def replaced() -> bool:
        names = ray_api.replica_actor_names(ENGINE_DEPLOYMENT)
        return not any(victim["replica"] in n for n in names)

    assert wait_until(replaced, timeout=60, interval=0.2), "Serve kept the replica whose engine died"
    replaced_after = time.monotonic() - killed
    print(f"replica with a dead engine replaced {replaced_after:.1f} s after kill -9")
    assert wait_until(lambda: len(_healthy_replicas(cluster)) == 2, timeout=120, interval=0.5)


def test_failover_when_a_replica_dies(cluster: Cluster) -> None:
    names = ray_api.replica_actor_names(ENGINE_DEPLOYMENT)
    assert len(names) == 2
    jobs = [(ADAPTERS[i % 4], TEXTS[i % 3], i % 2 == 0) for i in range(24)]

    def run(job):
        adapter, text, stream = job
        if stream:
            return adapter, text, _stream(cluster.url, adapter, text)
        r = _complete(cluster.url, adapter, text)
        body = r.json()
        got = body["choices"][0]["text"] if r.status_code == 200 else body["error"]["message"]
        return adapter, text, (r.status_code, got, False)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        time.sleep(1.0)
        ray_api.kill_actor(names[0])
        results = [f.result(timeout=90) for f in futures]  # none hangs
    for adapter, text, (status, got, error) in results:
        if status == 200 and not error:
            assert got == EXPECTED[adapter](text)
        else:
            assert status == 503 or error, (adapter, status, got)
    # Serve restarts the replica; then every adapter answers correctly again, and the adapters that
    # moved to the survivor rebalance onto the new replica (both serve again, none stranded)
    assert wait_until(lambda: len(_healthy_replicas(cluster)) == 2, timeout=90, interval=0.5)
    assert names[0] not in ray_api.replica_actor_names(ENGINE_DEPLOYMENT)
    rebalances = _rebalances(cluster)
    served: dict[str, set[str]] = {}
    for _ in range(3):
        for adapter in ADAPTERS:
            r = _complete(cluster.url, adapter, "hello world")
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == EXPECTED[adapter]("hello world")
            served.setdefault(r.headers["x-loraplex-replica"], set()).add(adapter)
    assert len(served) == 2, served
    assert _rebalances(cluster) > rebalances


def _rebalances(cluster: Cluster) -> float:
    m = cluster.router_metrics()
    return sum(v for (name, _), v in m.items() if name == "loraplex_router_adapter_rebalances_total")


def _healthy_replicas(cluster: Cluster) -> list[dict]:
    try:
        return [r for r in cluster.replicas() if r["healthy"]]
    except (httpx.HTTPError, AssertionError):
        return []


class Bystander:
    """Another team's Serve application on the same cluster."""

    def __call__(self, request) -> str:
        return "still here"


def test_removing_loraplex_leaves_other_serve_applications_alone(cluster: Cluster) -> None:
    """What `--ray-address` shutdown does (`ray_api.shutdown(own_cluster=False)`, before disconnecting):
    delete loraplex's application only. Runs last: it removes the module's application."""
    from ray import serve

    serve.run(
        ray_api.deployment(Bystander, name="Bystander", num_replicas=1, max_ongoing_requests=4).bind(),
        name="bystander",
        route_prefix="/bystander",
    )
    assert ray_api.app_names() == ["bystander", ray_api.APP_NAME]
    ray_api.delete_app()
    assert ray_api.app_names() == ["bystander"]
    assert httpx.get(cluster.url + "/bystander", timeout=30).text == "still here"
