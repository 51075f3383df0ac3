"""The decode side of a KV handoff: the blocks' path from the decode replica to its engine's cache.

    python -m bench.cluster.kv_import --tokens 1024 --layers 6 --kv-heads 4 --repeats 30

For one prompt's blocks (fetched from the object store as the "host-layers" chunks), interleaved, each
`--kv-staging` way (api/cluster/disaggregated/handoff.py, engine/kv_transfer/):
- "zmq": the replica copies the chunks into the encoded export, inline in the `ImportRequest` it sends
  over a ZeroMQ socket; the engine receives and decodes the message and copies the blocks in (host).
- "shm": the replica writes the chunks to a shared-memory file (a worker thread in the server), sends
  the small `ImportRequest` naming it; the engine receives it and reads the file into the blocks (one
  `preadv` per layer and K/V).
Reported, median ms: the replica's event-loop time (what stalls its relaying of the running streams'
tokens), its worker-thread time, the engine's step-loop time (receive + decode: what stalls its running
decodes) and its copier thread's time (the copy into the blocks, which runs beside the steps since the
copier thread; before, the step loop ran it too). The KV cache's shape defaults to `bench.cluster.disagg`'s
wide model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench kv_import", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    import os
    import tempfile

    import msgspec
    import numpy as np
    import torch
    import zmq

    from api.engine_protocol import ImportRequest, decode_to_engine, encode
    from bench.common.hog import cpu_summary
    from engine.kv_transfer import KVExport, TransferState, make_connector
    from engine.kv_transfer.connector import receiver_for
    from engine.kv_transfer.shm_stage import stage, unstage
    from engine.kv_transfer.state import decode_export, encode_export
    from engine.sampling_params import SamplingParams

    nblocks = -(-args.tokens // args.block_size)
    shape = (args.layers, 2, 2 * nblocks + 8, args.block_size, args.kv_heads, args.head_dim)
    src, dst = torch.randn(shape), torch.zeros(shape)
    sent = make_connector("host-layers").send("r", src, list(range(nblocks)), args.tokens)
    fetched = [np.frombuffer(c, dtype=np.uint8) for c in sent.chunks]  # as Ray hands them out
    state = TransferState("r", list(range(args.tokens)), [5], SamplingParams(max_tokens=8))
    engine_conn = make_connector("host-layers")
    ids = list(range(nblocks, 2 * nblocks))
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        addr = f"ipc://{os.path.join(tmp, 'sock')}"
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(addr)
        push.connect(addr)
        times: dict[str, list[tuple[float, float, float, float]]] = {"zmq": [], "shm": []}
        for i in range(args.repeats + 2):
            for way in ("zmq", "shm"):
                t0 = time.perf_counter()
                path = None
                if way == "zmq":
                    blocks = msgspec.structs.replace(sent, chunks=[bytes(c) for c in fetched])
                    t_thread = 0.0
                else:
                    blocks = stage(sent.layout, sent.num_blocks, sent.num_tokens, fetched)
                    path = blocks.path
                    t_thread = time.perf_counter() - t0
                    t0 = time.perf_counter()
                push.send(encode(ImportRequest("r", encode_export(KVExport(state, blocks)))))
                t_loop = time.perf_counter() - t0
                pull.poll(1000)
                t1 = time.perf_counter()
                msg = decode_to_engine(pull.recv())
                assert isinstance(msg, ImportRequest)
                export = decode_export(msg.export)
                t_engine = time.perf_counter() - t1
                t1 = time.perf_counter()
                receiver_for(export.blocks, engine_conn).receive(export.blocks, dst, ids, 0)
                t_copy = time.perf_counter() - t1
                unstage(path)
                assert torch.equal(dst[:, :, nblocks : 2 * nblocks], src[:, :, :nblocks])
                dst.zero_()
                if i >= 2:
                    times[way].append((t_loop, t_thread, t_engine, t_copy))
        push.close(0)
        pull.close(0)
    ctx.term()
    print(cpu_summary())
    print(f"{args.tokens} tokens, {sent.nbytes / 2**20:.1f} MiB of KV, {args.repeats} interleaved repeats")
    print("| staging | replica event loop (ms) | replica worker thread (ms) | engine step loop (ms) "
          "| engine copier thread (ms) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for way, rows in times.items():
        med = [1e3 * statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"| {way} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {med[3]:.1f} |")


if __name__ == "__main__":
    main()
