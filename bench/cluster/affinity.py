"""Cluster benchmark: routers of the engine replicas on Ray Serve, on one trace above their capacity.

    loraplex bench cluster --replicas 2 --runs 3 --routers pow2,multiplex,ray-prefix,affinity

One local Ray cluster, `--replicas` engine replicas of a random-weight Llama (built here; no download)
with 16 random rank-8 adapters (`bench.cluster.workload`): 8 shared system prompts × 16 adapters with
power-law popularity, base-model multi-turn chats, then a hot-adapter burst. The trace is built once and
replayed identically for every router (`bench.cluster.routers`, by name: `affinity` is whatever
`loraplex serve --router affinity` deploys at this commit), each on a freshly deployed engine deployment
(cold caches), `--runs` times, the routers' order rotated between runs. Reported per router, median and
min–max over the runs (`bench.cluster.report`): prefix-hit rate (the replicas' own counters), adapter
loads per 1k requests, throughput, TTFT p50/p99 and burst p99, and the queue's growth and drain, which
shows whether the arrival rate was above what the replicas drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from api.cluster.options import HOLD_MARGIN
from bench.cluster.report import RunMetrics, markdown, run_metrics
from bench.cluster.routers import ROUTERS, plan, ray_prefix_router_status
from bench.cluster.workload import WorkloadSpec, attainable_hit_rate, build_trace

MAX_ARRIVALS = 20_000


def model_spec(vocab_size: int, max_len: int):
    """The random model: small enough for 2 CPU replicas, prefill-heavy enough that prefix hits count."""
    from bench.common.workload import ModelSpec

    return ModelSpec(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_layers=4,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=max_len)  # fmt: skip


def prepare(root: Path, args: argparse.Namespace, spec: WorkloadSpec):
    """Build the model and adapters under `root`, register the adapters; (settings, [(name, digest)])."""
    from api.settings import ServerSettings
    from bench.common.workload import build_adapter, build_base
    from lora_registry import open_registry

    max_len = 1 << max(9, (spec.longest_prompt() + spec.max_tokens).bit_length())
    mspec = model_spec(spec.vocab_size, max_len)
    base = build_base(root, mspec, seed=args.seed)
    env = {"LORAPLEX_DATA_DIR": str(root / "data"), "LORAPLEX_MODEL": str(base)}
    engine = dict(
        device="cpu",
        dtype="float32",
        num_threads=args.threads,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.rank,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.kv_blocks,
    )
    settings = ServerSettings.build(str(base), env=env, engine_kwargs=engine)
    settings.registry_resync_seconds = 1.0
    assert settings.registry is not None
    reg = open_registry(settings.registry)
    digests = []
    try:
        for k in range(spec.adapters):
            path = build_adapter(root / "adapters" / f"a{k:02d}", mspec, rank=args.rank, seed=1000 + k)
            res = reg.adapters.register(f"a{k:02d}", path, activate=True)
            digests.append((f"a{k:02d}", res.version.digest))
    finally:
        reg.close()
    return settings, digests


async def one_router(settings, name: str, args, trace, digests, spec: WorkloadSpec, run: int) -> RunMetrics:
    """Deploy the engine deployment for router `name`, replay the trace, remove the deployment."""
    from api.cluster import ray_api
    from api.cluster.deployments import ENGINE_DEPLOYMENT, engine_deployment
    from api.cluster.options import ClusterOptions, RouterQueue
    from api.cluster.remote_client import RemoteEngineClient
    from bench.cluster.replay import replay
    from bench.cluster.routers import router_config

    p = plan(name)
    queue = RouterQueue(args.router_max_ongoing, args.router_hold_margin)
    options = ClusterOptions(args.replicas, router=p.cluster_router, queue=queue)
    deployment = engine_deployment(settings, options, args.max_ongoing)
    if p.router_class is not None:
        deployment = deployment.options(request_router_config=router_config(p.router_class))
    await asyncio.to_thread(ray_api.run, deployment.bind(), None)
    client = RemoteEngineClient(settings.engine, ENGINE_DEPLOYMENT, affinity=p.model_id)
    await client.start()
    try:
        while len(client.replica_stats()) < args.replicas:  # every replica up and reporting
            await asyncio.sleep(0.5)
            await client.poll()
        rep = await replay(client, trace, digests, spec.max_tokens)
    finally:
        await client.shutdown()
        await asyncio.to_thread(ray_api.delete_app)
    result = run_metrics(name, run, rep, trace, spec.steady_s)
    print(
        f"run {run} {name:10s} ok {result.ok}/{result.requests} {result.req_per_s:.2f} req/s "
        f"hit {result.prefix_hit_rate:.1%} loads/1k {result.loads_per_1k:.0f} p99 {result.ttft_p99:.2f} s "
        f"drain {result.drain_s:.1f} s",
        file=sys.stderr,
    )
    return result


async def run_all(settings, args, trace, digests, spec: WorkloadSpec, routers: list[str]) -> list[RunMetrics]:
    results = []
    for run in range(args.runs):
        order = routers[run % len(routers) :] + routers[: run % len(routers)]  # rotate against drift
        for name in order:
            results.append(await one_router(settings, name, args, trace, digests, spec, run))
    return results


def spec_from(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        adapters=args.adapters,
        system_prompts=args.system_prompts,
        alpha=args.alpha,
        steady_s=args.steady_s,
        rate=args.rate,
        chats=args.chats,
        turns=args.turns,
        burst_s=args.burst_s,
        burst_rate=args.burst_rate if args.burst_rate is not None else 1.5 * args.rate,
        hot_share=args.hot_share,
        max_tokens=args.max_tokens,
        system_tokens=args.system_tokens,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="loraplex bench cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {', '.join(ROUTERS)}")
    ap.add_argument("--runs", type=int, default=3, help="replays of the trace per router")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of popularity")
    ap.add_argument("--steady-s", type=float, default=30.0, help="seconds of the steady phase")
    ap.add_argument("--rate", type=float, default=36.0, help="steady Poisson arrival rate (req/s)")
    ap.add_argument("--chats", type=int, default=24, help="base-model multi-turn conversations")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--burst-s", type=float, default=10.0, help="seconds of the hot-adapter burst")
    ap.add_argument("--burst-rate", type=float, default=None, help="burst arrival rate (default 1.5x --rate)")
    ap.add_argument("--hot-share", type=float, default=0.8, help="burst share of the hot adapter")
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=4, help="per replica")
    ap.add_argument("--max-cpu-loras", type=int, default=8, help="per replica host cache")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="per replica running batch")
    ap.add_argument("--kv-blocks", type=int, default=640, help="per replica KV cache blocks")
    ap.add_argument("--threads", type=int, default=1, help="engine threads per replica")
    ap.add_argument(
        "--max-ongoing",
        type=int,
        default=None,
        help="requests per replica before Serve queues (every router)",
    )
    ap.add_argument(
        "--router-max-ongoing", type=int, default=None, help="affinity: as `serve --router-max-ongoing`"
    )
    ap.add_argument(
        "--router-hold-margin",
        type=float,
        default=HOLD_MARGIN,
        help="affinity: as `serve --router-hold-margin`",
    )
    ap.add_argument("--ray-num-cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    try:
        for r in routers:
            plan(r)
        spec = spec_from(args)
        trace = build_trace(spec)
    except ValueError as exc:
        ap.error(str(exc))
    if args.replicas < 1 or args.runs < 1 or not 0 < len(trace) <= MAX_ARRIVALS:
        ap.error(f"--replicas and --runs must be positive and the trace hold 1..{MAX_ARRIVALS} arrivals")
    notes = []
    if "ray-prefix" in routers and (why := ray_prefix_router_status()) is not None:
        routers.remove("ray-prefix")
        notes.append(f"ray-prefix left out: {why}")
    from api.cluster import ray_api
    from api.cluster.options import ClusterOptions, RouterQueue

    try:
        ClusterOptions(
            args.replicas, queue=RouterQueue(args.router_max_ongoing, args.router_hold_margin)
        ).validate()
    except ValueError as exc:
        ap.error(str(exc))
    offered = len(trace) / (spec.steady_s + spec.burst_s)
    print(f"trace: {len(trace)} requests over {spec.steady_s + spec.burst_s:.0f} s ({offered:.2f} req/s)",
          file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-cluster-") as tmp:
        settings, digests = prepare(Path(tmp), args, spec)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ray_api.init(None, args.ray_num_cpus)
        try:
            ray_api.start_http("127.0.0.1", port)
            results = asyncio.run(run_all(settings, args, trace, digests, spec, routers))
        finally:
            ray_api.shutdown()
    attainable = attainable_hit_rate(trace, settings.engine.block_size)
    single = attainable_hit_rate(trace, settings.engine.block_size, settings.engine.num_kv_blocks)
    print(markdown(results, offered, attainable, single))
    for note in notes:
        print(f"\n{note}")
    if args.json:
        doc = {"argv": argv or sys.argv[1:], "notes": notes, "runs": [r.to_json() for r in results]}
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
