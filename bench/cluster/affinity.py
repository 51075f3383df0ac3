"""Cluster benchmark: adapter-affinity routing (Ray Serve multiplexing) vs plain load balancing.

    loraplex bench cluster --replicas 2 --adapters 16 --requests 400 --rate 40

One local Ray cluster with N engine replicas of the demo model (`demo/base`). Two traffic phases run
against the same replicas, one after the other: "balanced" sends requests without a multiplexed id
(Ray's default routing: power of two choices on queue length, no adapter affinity), "multiplexed" sends
each request with its adapter's digest as multiplexed id. Each phase has its own set of `--adapters`
adapters (copies of the four demo adapters with slightly scaled weights, so each has its own digest), so
neither phase finds the other's adapters resident. Requests arrive as a Poisson process at `--rate`
req/s, adapter k drawn with probability ∝ 1/(k+1)^alpha. Reported per phase: adapter loads into the
replicas' pools (host loads from disk and device-pool uploads) per 1,000 requests, and throughput
(requests and output tokens per second, from first arrival to last completion). Replica pools are
small on purpose (`--max-loras`, `--max-cpu-loras`): one replica cannot hold every adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEMO = Path(__file__).resolve().parents[2] / "demo"
DEMO_ADAPTERS = ("upper", "reverse", "rot13", "novowels")
MAX_REQUESTS = 5000


@dataclass(slots=True)
class PhaseResult:
    routing: str
    requests: int
    ok: int
    seconds: float
    output_tokens: int
    host_loads: int
    device_uploads: int
    multiplexed_loads: int  # LRU misses of Ray's multiplexed loaders (0 without affinity)

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def per_1000(self, n: int) -> float:
        return 1000.0 * n / self.requests if self.requests else 0.0


def markdown(phases: list[PhaseResult]) -> str:
    rows = [
        "| routing | requests (ok) | host loads / 1k req | device uploads / 1k req | req/s | output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for p in phases:
        rows.append(
            f"| {p.routing} | {p.requests} ({p.ok}) | {p.per_1000(p.host_loads):.0f} | "
            f"{p.per_1000(p.device_uploads):.0f} | {p.requests_per_s:.1f} | "
            f"{p.output_tokens / p.seconds:.0f} |"
        )
    if len(phases) == 2:
        b, m = phases
        rows.append(
            f"\nmultiplexed vs balanced: {b.device_uploads / max(m.device_uploads, 1):.1f}x fewer "
            "device uploads, "
            f"{b.host_loads / max(m.host_loads, 1):.1f}x fewer host loads, "
            f"{m.requests_per_s / b.requests_per_s:.2f}x the throughput"
        )
    return "\n".join(rows)


def make_adapters(root: Path, count: int, tag: int) -> list[Path]:
    """`count` distinct adapters: demo adapter k % 4 with lora_B scaled by 1 + 1e-3 * (k + 1 + 100 * tag)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = []
    for k in range(count):
        src = DEMO / "adapters" / DEMO_ADAPTERS[k % len(DEMO_ADAPTERS)]
        dst = root / f"p{tag}-a{k:02d}"
        dst.mkdir(parents=True)
        shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
        weights = load_file(src / "adapter_model.safetensors")
        scale = 1.0 + 1e-3 * (k + 1 + 100 * tag)
        scaled = {n: (t * scale if "lora_B" in n else t).contiguous() for n, t in weights.items()}
        save_file(scaled, dst / "adapter_model.safetensors")
        out.append(dst)
    return out


def popularity(count: int, alpha: float) -> list[float]:
    w = [1.0 / (k + 1) ** alpha for k in range(count)]
    return [x / sum(w) for x in w]


def random_text(rng: random.Random) -> str:
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 6)))
        for _ in range(rng.randint(1, 3))
    ]
    return " ".join(words)


async def run_phase(client, routing: str, adapters, args, tokenizer) -> PhaseResult:
    """Poisson arrivals over `adapters` ([(name, digest)]) through `client`; loads from the replicas."""
    from api.engine_protocol import AddRequest
    from bench.common.progress import progress
    from engine import LoRARequest, SamplingParams

    rng = random.Random(args.seed)
    weights = popularity(len(adapters), args.alpha)
    await client.poll()
    before = _pool_counters(client)
    ok = tokens = 0

    async def one(i: int, name: str, digest: str) -> None:
        nonlocal ok, tokens
        ids = tokenizer.encode(random_text(rng) + "=")
        req = AddRequest(
            request_id=f"{routing}-{i}",
            prompt_token_ids=ids,
            params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
            lora=LoRARequest(name, "", digest),  # each replica fills in its own path for the digest
        )
        n = 0
        try:
            async for delta in client.generate(req):
                n += len(delta.token_ids)
            ok += 1
            tokens += n
        except Exception as exc:  # counted as not ok
            print(f"request {i} failed: {exc}", file=sys.stderr)

    tasks = []
    t0 = time.monotonic()
    with progress(args.quiet) as bar:
        task = bar.add_task(f"{routing:11s}", total=args.requests)
        for i in range(args.requests):
            name, digest = rng.choices(adapters, weights)[0]
            t = asyncio.create_task(one(i, name, digest))
            t.add_done_callback(lambda _: bar.advance(task))
            tasks.append(t)
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    seconds = time.monotonic() - t0
    await client.poll()
    after = _pool_counters(client)
    return PhaseResult(
        routing,
        args.requests,
        ok,
        seconds,
        tokens,
        after[0] - before[0],
        after[1] - before[1],
        after[2] - before[2],
    )


def _pool_counters(client) -> tuple[int, int, int]:
    """(host loads, device uploads, multiplexed loader misses) summed over the live replicas."""
    from api.engine_protocol import decode_from_engine

    loads = uploads = misses = 0
    for r in client.replicas:
        misses += r["multiplexed_loads"]
        lora = decode_from_engine(r["stats"]).lora if r["stats"] else None
        if lora:
            loads, uploads = loads + lora["loads"], uploads + lora["device_uploads"]
    return loads, uploads, misses


async def _drive(settings, phases_adapters, args) -> list[PhaseResult]:
    from api.cluster.deployments import ENGINE_DEPLOYMENT
    from api.cluster.remote_client import RemoteEngineClient
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(settings.model)
    results = []
    for routing, adapters in phases_adapters:
        client = RemoteEngineClient(settings.engine, ENGINE_DEPLOYMENT, affinity=routing == "multiplexed")
        await client.start()
        try:
            results.append(await run_phase(client, routing, adapters, args, tokenizer))
        finally:
            await client.shutdown()
    return results


def run(args: argparse.Namespace) -> list[PhaseResult]:
    """Register both phases' adapters in a fresh registry, start the cluster, run both phases."""
    import socket

    from api.cluster import ray_api
    from api.cluster.deployments import engine_deployment
    from api.cluster.options import ClusterOptions
    from api.settings import ServerSettings
    from bench.common.progress import progress
    from lora_registry import open_registry

    with tempfile.TemporaryDirectory(prefix="loraplex-bench-cluster-") as tmp:
        root = Path(tmp)
        env = {"LORAPLEX_DATA_DIR": str(root / "data"), "LORAPLEX_MODEL": str(DEMO / "base")}
        engine = dict(
            device="cpu",
            dtype="float32",
            num_threads=args.threads,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
            max_lora_rank=16,
            num_kv_blocks=256,
        )
        settings = ServerSettings.build(str(DEMO / "base"), env=env, engine_kwargs=engine)
        settings.registry_resync_seconds = 1.0
        reg = open_registry(settings.registry)
        phases = []
        try:
            with progress(args.quiet) as bar:
                task = bar.add_task("register", total=2 * args.adapters)
                for tag, routing in enumerate(("balanced", "multiplexed")):
                    pairs = []
                    for path in make_adapters(root / "adapters", args.adapters, tag):
                        res = reg.adapters.register(path.name, path, activate=True)
                        pairs.append((path.name, res.version.digest))
                        bar.advance(task)
                    phases.append((routing, pairs))
        finally:
            reg.close()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ray_api.init(None, args.ray_num_cpus)
        try:
            ray_api.start_http("127.0.0.1", port)
            # Serve's own router: "balanced" (no id: power of two choices) vs "multiplexed" (the digest as
            # id), as documented; the affinity router is not one of this benchmark's phases yet
            options = ClusterOptions(args.replicas, router="multiplex")
            app = engine_deployment(settings, options, args.max_ongoing).bind()
            ray_api.run(app, route_prefix=None)
            return asyncio.run(_drive(settings, phases, args))
        finally:
            ray_api.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="loraplex bench cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=16, help="adapters per phase")
    ap.add_argument("--requests", type=int, default=600, help="requests per phase")
    ap.add_argument("--rate", type=float, default=30.0, help="Poisson arrival rate (req/s)")
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of adapter popularity")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4, help="per replica (pool: 2x as many adapters)")
    ap.add_argument("--max-cpu-loras", type=int, default=8, help="per replica host cache")
    ap.add_argument("--threads", type=int, default=1, help="engine threads per replica")
    ap.add_argument(
        "--max-ongoing", type=int, default=None, help="requests per replica before Ray spills (default: 256)"
    )
    ap.add_argument("--ray-num-cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS:
        ap.error(f"--requests must be in [1, {MAX_REQUESTS}]")
    if args.rate <= 0 or args.replicas < 1 or args.adapters < 1:
        ap.error("--rate, --replicas and --adapters must be positive")
    phases = run(args)
    print(markdown(phases))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(p) for p in phases], indent=2))


if __name__ == "__main__":
    main()
