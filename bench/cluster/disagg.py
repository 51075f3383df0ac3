"""Prefill/decode disaggregation vs colocated replicas on the same cores.

    loraplex bench disagg --seconds 60 --streams 4 --long-rate 0.5 --long-tokens 1024 --runs 3

One local Ray cluster per setup and run, the setups interleaved (colocated, disaggregated, colocated, …,
`--runs` times each, the same workload every time), each engine replica at `--threads` thread(s):
"colocated" is `--replicas 2` (the affinity router), "disaggregated" is `--prefill-replicas 1 --decode-
replicas 1 --local-prefill-tokens N` (`--local-prefill-tokens`, default 256: the streams' short prompts run
whole on the decode replica, the long ones are prefilled on the prefill replica and their KV handed over; 0:
every prompt is). The model is a random Llama (`bench.common.workload.ModelSpec`, 2,048 positions) with
`--adapters` random rank-8 adapters. Workload, the same in both: `--streams` steady decode streams (short
prompts, `--stream-tokens` tokens each, adapters round-robin with the base model, a new request as soon as
one ends) plus long prompts (`--long-tokens` tokens, `--long-max-tokens` out) arriving as a Poisson process
at `--long-rate` req/s, for `--seconds`. Driven from this process through the same engine clients the HTTP
ingress uses (no HTTP). Reported per setup: inter-token latency p50/p99/p99.9 of the steady streams, TTFT
p50/p99 of the streams and of the long prompts, output tokens/s, and (disaggregated) the KV transfer time per
request (`loraplex_kv_transfer_seconds`) and bytes: median and min–max over the runs, and the ratios
disaggregated / colocated of each run's pair (ITL p99, throughput) against the issue's goals. Greedy tokens
of every long prompt are compared between the setups of each run (same prompts, same seeds). `--json`: every
run, the summary and the machine's load averages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.disagg_report import (
    SETUPS,
    SetupResult,
    identical_long,
    markdown,
    ratios,
    summary,
)

SPEC = dict(vocab_size=2000, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
            num_kv_heads=2, max_position_embeddings=2048)  # fmt: skip


def poisson_arrivals(rng: random.Random, rate: float, seconds: float) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process at `rate` per second that fall inside
    the window [0, seconds): exponential gaps drawn from `rng` until one passes the window's end (so a low
    rate neither overruns the window nor submits a request after the streams have stopped)."""
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def drive(client, adapters: list[tuple[str, str]], args: argparse.Namespace, setup: str) -> SetupResult:
    """Run the workload through `client` (a started engine client) for `args.seconds`."""
    from api.engine_protocol import AddRequest
    from engine import LoRARequest, SamplingParams

    rng = random.Random(args.seed)
    itl: list[float] = []
    ttft_stream: list[float] = []
    ttft_long: list[float] = []
    long_tokens: dict[str, list[int]] = {}
    counts = {"requests": 0, "failed": 0, "tokens": 0}
    choices = [None, *adapters]
    t_end = time.monotonic() + args.seconds

    async def one(rid: str, prompt: list[int], max_tokens: int, lora, long: bool) -> None:
        req = AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                         lora=None if lora is None else LoRARequest(lora[0], "", lora[1]))  # fmt: skip
        t0 = last = time.monotonic()
        toks: list[int] = []
        counts["requests"] += 1
        try:
            async for delta in client.generate(req):
                now = time.monotonic()
                if delta.token_ids:
                    if not toks:
                        (ttft_long if long else ttft_stream).append(now - t0)
                    elif not long:
                        itl.append(now - last)
                    toks += delta.token_ids
                    last = now
        except Exception as exc:
            counts["failed"] += 1
            print(f"{setup}: request {rid} failed: {exc}", file=sys.stderr)
        counts["tokens"] += len(toks)
        if long:
            long_tokens[rid] = toks

    async def stream(k: int) -> None:
        i = 0
        while time.monotonic() < t_end:
            prompt = [rng.randrange(3, 1900) for _ in range(args.stream_prompt)]
            await one(f"s{k}-{i}", prompt, args.stream_tokens, choices[(k + i) % len(choices)], False)
            i += 1

    async def long_prompts() -> None:
        tasks = []
        lrng = random.Random(args.seed + 1)  # the same arrivals and prompts in both setups
        start = time.monotonic()
        for i, at in enumerate(poisson_arrivals(lrng, args.long_rate, args.seconds)):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            prompt = [lrng.randrange(3, 1900) for _ in range(args.long_tokens)]
            lora = choices[i % len(choices)]
            tasks.append(asyncio.create_task(one(f"L{i}", prompt, args.long_max_tokens, lora, True)))
        await asyncio.gather(*tasks)

    t0 = time.monotonic()
    await asyncio.gather(*(stream(k) for k in range(args.streams)), long_prompts())
    seconds = time.monotonic() - t0
    res = SetupResult(
        setup, seconds, counts["requests"], counts["failed"], counts["tokens"],
        1e3 * pct(itl, 0.5), 1e3 * pct(itl, 0.99), 1e3 * pct(ttft_stream, 0.5), 1e3 * pct(ttft_stream, 0.99),
        1e3 * pct(ttft_long, 0.5), 1e3 * pct(ttft_long, 0.99), counts["tokens"] / seconds,
        long_tokens=long_tokens, itl_p999_ms=1e3 * pct(itl, 0.999),
    )  # fmt: skip
    kv = getattr(client, "kv_metrics", None)
    if kv is not None:
        n = kv.transfers.labels("ok")._value.get()
        secs = sum(s.value for m in kv.seconds.collect() for s in m.samples if s.name.endswith("_sum"))
        res.transfer_ms_per_request = 1e3 * secs / n if n else None
        res.transfer_kib_per_request = kv.bytes._value.get() / 1024 / n if n else None
    return res


def run_setup(setup: str, root: Path, args: argparse.Namespace, run: int = 0) -> SetupResult:
    """Start a local cluster with `setup`'s layout on the model and adapters under `root`; drive it
    (`run`: which of the `--runs` this is; each has its own registry)."""
    from api.cluster import ray_api
    from api.cluster.options import ClusterOptions
    from api.cluster.run import start_cluster
    from api.settings import ServerSettings
    from lora_registry import open_registry

    base = root / "base"
    env = {"LORAPLEX_DATA_DIR": str(root / f"data-{setup}-{run}"), "LORAPLEX_MODEL": str(base)}
    engine = dict(device="cpu", dtype="float32", num_threads=args.threads, max_lora_rank=16,
                  num_kv_blocks=args.kv_blocks, max_num_batched_tokens=args.batched_tokens)  # fmt: skip
    settings = ServerSettings.build(str(base), env=env, engine_kwargs=engine)
    settings.registry_resync_seconds = 1.0
    reg = open_registry(settings.registry)
    try:
        adapters = []
        for path in sorted((root / "adapters").iterdir()):
            res = reg.adapters.register(path.name, path, activate=True)
            adapters.append((path.name, res.version.digest))
    finally:
        reg.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        settings.port = s.getsockname()[1]
    if setup == "colocated":
        options = ClusterOptions(2, num_cpus=args.ray_num_cpus)
    else:
        options = ClusterOptions(
            0,
            num_cpus=args.ray_num_cpus,
            prefill_replicas=1,
            decode_replicas=1,
            local_prefill_tokens=args.local_prefill_tokens,
            kv_staging="zmq" if setup == "disaggregated-zmq" else args.kv_staging,
        )
    try:
        start_cluster(settings, options)
        result = asyncio.run(_with_client(settings, setup, adapters, args))
    finally:
        ray_api.shutdown()
    result.run, result.load = run, os.getloadavg()
    print(f"run {run} {setup}: ITL p99 {result.itl_p99_ms:.1f} ms, {result.tokens_per_s:.1f} tok/s, "
          f"{result.requests} requests ({result.failed} failed), load {result.load[0]:.1f}",
          file=sys.stderr)  # fmt: skip
    return result


async def _with_client(settings, setup: str, adapters, args) -> SetupResult:
    from api.cluster.deployments import ENGINE_DEPLOYMENT
    from api.cluster.disaggregated.app import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT
    from api.cluster.disaggregated.client import DisaggregatedClient
    from api.cluster.options import KV_TRANSFER_TIMEOUT_S
    from api.cluster.remote_client import RemoteEngineClient

    if setup == "colocated":
        client = RemoteEngineClient(settings.engine, ENGINE_DEPLOYMENT, affinity=False)
    else:
        client = DisaggregatedClient(
            settings.engine,
            PREFILL_DEPLOYMENT,
            DECODE_DEPLOYMENT,
            KV_TRANSFER_TIMEOUT_S,
            local_prefill_tokens=args.local_prefill_tokens,
        )
    await client.start()
    try:
        warm = argparse.Namespace(**{**vars(args), "seconds": 3.0, "seed": args.seed + 100})
        await drive(client, adapters, warm, setup)  # adapters resident, code paths warm
        return await drive(client, adapters, args, setup)
    finally:
        await client.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="loraplex bench disagg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--streams", type=int, default=4, help="steady decode streams")
    ap.add_argument("--stream-prompt", type=int, default=32, help="prompt tokens of a stream's request")
    ap.add_argument("--stream-tokens", type=int, default=64, help="output tokens of a stream's request")
    ap.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second (Poisson)")
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=SPEC["hidden_size"], help="model width (heads of 64)")
    ap.add_argument("--layers", type=int, default=SPEC["num_layers"])
    ap.add_argument("--threads", type=int, default=1, help="engine threads per replica")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--batched-tokens", type=int, default=512, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--local-prefill-tokens", type=int, default=256,
                    help="disaggregated: prompts of at most this many tokens run whole on the decode replica "
                         "(no KV handoff); 0: every prompt is prefilled on the prefill replica")  # fmt: skip
    ap.add_argument("--kv-staging", default="shm", choices=("shm", "zmq"),
                    help="disaggregated: how a decode replica hands KV blocks to its engine")  # fmt: skip
    ap.add_argument("--ray-num-cpus", type=int, default=2)
    ap.add_argument("--setups", default="colocated,disaggregated", help="comma-separated, run in this order")
    ap.add_argument("--runs", type=int, default=1, help="runs of each setup, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    if (
        args.seconds <= 0
        or args.streams < 0
        or args.long_rate <= 0
        or args.long_tokens + args.long_max_tokens > 2048
    ):
        ap.error("--seconds and --long-rate must be positive, --long-tokens + --long-max-tokens <= 2048")
    if args.local_prefill_tokens < 0 or args.local_prefill_tokens >= args.long_tokens:
        ap.error("--local-prefill-tokens must be in [0, --long-tokens): the long prompts are disaggregated")
    if args.runs < 1 or not setups or not set(setups) <= SETUPS:
        ap.error(f"--runs must be at least 1 and --setups name some of {', '.join(sorted(SETUPS))}")
    from bench.common.hog import cpu_summary
    from bench.common.workload import ModelSpec, build_adapter, build_base

    results = []
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-disagg-") as tmp:
        root = Path(tmp)
        shape = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_layers": args.layers,
                 "num_heads": args.hidden // 64, "num_kv_heads": max(1, args.hidden // 128)}  # fmt: skip
        spec = ModelSpec(**(SPEC | shape))
        build_base(root, spec)
        for i in range(args.adapters):
            build_adapter(root / "adapters" / f"ad{i}", spec, rank=8, seed=i + 1)
        for run in range(args.runs):  # interleaved: colocated, disaggregated, colocated, ...
            for setup in setups:
                results.append(run_setup(setup, root, args, run))
    cpu = cpu_summary()
    print(cpu)
    print(markdown(results))
    if args.json:
        same, total = identical_long(results)
        doc = {
            "argv": argv if argv is not None else sys.argv[1:],
            "cpu": cpu,
            "summary": summary(results),
            "ratios": ratios(results),
            "identical_long": {"same": same, "of": total},
            "runs": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
