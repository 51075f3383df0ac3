"""KV transfer through Ray's object store: one piece vs one chunk per layer.

    python -m bench.cluster.kv_transfer --tokens 128,1024,2048 --repeats 20

For a prompt of each length: the prefill side's `connector.send` (blocks copied to host bytes), `ray.put`
of the chunks, a task in another worker process fetching them (`ray.get`) and `connector.receive` into
its own KV cache (the decode side), end to end, for the `host` (one piece) and `host-layers` connectors.
The KV cache has the shape of `bench.cluster.disagg`'s model by default (4 layers, 2 KV heads of 64,
float32, 16-token blocks). Reported: median milliseconds per transfer and MB/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _receiver(shape: tuple[int, ...], blocks_meta: bytes, refs: list, first_blocks: int) -> float:
    """In another worker: fetch the chunks, receive them into a fresh cache; seconds taken there."""
    import msgspec
    import ray
    import torch

    from engine.kv_transfer import KVBlocks, make_connector

    t0 = time.perf_counter()
    chunks = ray.get(refs)
    meta = msgspec.msgpack.decode(blocks_meta, type=KVBlocks)
    blocks = msgspec.structs.replace(meta, chunks=list(chunks))
    cache = torch.zeros(shape)
    make_connector(blocks.connector).receive(blocks, cache, list(range(first_blocks)), 0)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench kv_transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,1024,2048")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    import msgspec
    import ray
    import torch

    from bench.common.hog import cpu_summary
    from engine.kv_transfer import make_connector

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 1024**2)
    receiver = ray.remote(num_cpus=0)(_receiver)
    try:
        rows = []
        for n in (int(t) for t in args.tokens.split(",")):
            nblocks = -(-n // args.block_size)
            shape = (args.layers, 2, nblocks + 8, args.block_size, args.kv_heads, args.head_dim)
            cache = torch.randn(shape)
            for name in ("host", "host-layers"):
                conn = make_connector(name)
                times = []
                for _ in range(args.repeats + 2):
                    t0 = time.perf_counter()
                    blocks = conn.send("r", cache, list(range(nblocks)), n)
                    refs = [ray.put(c) for c in blocks.chunks]
                    meta = msgspec.msgpack.encode(msgspec.structs.replace(blocks, chunks=[]))
                    ray.get(receiver.remote(shape, meta, refs, nblocks))
                    times.append(time.perf_counter() - t0)
                t = statistics.median(times[2:])
                rows.append((n, name, blocks.nbytes, t))
        print(cpu_summary())
        print("| prompt tokens | connector | KV bytes | ms per transfer (median) | MB/s |")
        print("|---|---|---|---|---|")
        for n, name, nbytes, t in rows:
            print(f"| {n} | {name} | {nbytes / 1024:.0f} KiB | {1e3 * t:.1f} | {nbytes / t / 1e6:.0f} |")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
