"""The server and engine options of `loraplex serve` (`api/cli/serve.py`): listening, API keys,
adapters given at start, the engine's settings (vLLM's flag names) and shutdown, one type alias an
option (the command's parameter keeps its default); the Ray Serve ones are in `serve_cluster_flags.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Host = Annotated[str, typer.Option(help="Interface to listen on.")]

Port = Annotated[int, typer.Option(help="TCP port.")]

Device = Annotated[str | None, typer.Option(help="auto, cpu or cuda.")]

Dtype = Annotated[str | None, typer.Option(help="auto, float32, bfloat16 or float16.")]

ServedModelName = Annotated[str | None, typer.Option(help="Model id of the base model.")]

RequireApiKey = Annotated[bool, typer.Option(help="Require an API key for inference.")]

ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="VLLM_API_KEY",
        help="vLLM's --api-key: one static key for inference (every model), beside the registry's "
        "keys; implies --require-api-key.",
    ),
]

LoraModules = Annotated[
    list[str] | None,
    typer.Option(
        help='vLLM\'s --lora-modules: name=path or {"name": ..., "path": ...}, several after one flag; '
        "each is registered (a new version if its content is new) and activated before serving.",
    ),
]

EnableLora = Annotated[
    bool, typer.Option("--enable-lora", help="Accepted for vLLM: LoRA is always on in loraplex.")
]

MaxCpuLoras = Annotated[
    int | None, typer.Option(help="Adapters kept in the host-memory tier (vLLM's meaning).", min=1)
]

MaxModelLen = Annotated[
    int | None, typer.Option(help="Cap on prompt + output tokens (default: the model's context).", min=2)
]

GpuMemoryUtilization = Annotated[
    float | None,
    typer.Option(
        help="CUDA: fraction of the device's memory this server may use; the KV cache gets what the "
        "model leaves of it (default: 90% of free memory). Accepted and unused on CPU.",
        min=0.0,
        max=1.0,
    ),
]

EnablePrefixCaching = Annotated[
    bool | None,
    typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse cached prompt prefixes (default on).",
    ),
]

ChatTemplate = Annotated[
    str | None, typer.Option(help="Jinja chat template, as a file or inline, in place of the model's.")
]

Tokenizer = Annotated[Path | None, typer.Option(help="Tokenizer directory (default: the model's own).")]

Seed = Annotated[int | None, typer.Option(help="Engine random seed (default 0).")]

MaxNumBatchedTokens = Annotated[int | None, typer.Option(help="Most tokens in one engine step.", min=1)]

EnableAutoToolChoice = Annotated[
    bool,
    typer.Option(
        "--enable-auto-tool-choice", help="Accepted for vLLM: tool_choice auto is always available."
    ),
]

ToolCallParser = Annotated[
    str | None,
    typer.Option(
        help='How tool calls are read: json (a reply that is {"name", "arguments"}); others refused.'
    ),
]

MaxSeqsPerClient = Annotated[
    int | None,
    typer.Option(
        help="Engine sequences one API key (or, without keys, one client address) is guaranteed at "
        "once (default: half of the engine's max_num_seqs); beyond it a client borrows idle capacity, "
        "first come, first served.",
        min=1,
    ),
]

MaxLoras = Annotated[int | None, typer.Option(help="Distinct adapters in one step.")]

MaxLoraRank = Annotated[int | None, typer.Option(help="Largest adapter rank accepted.")]

MaxNumSeqs = Annotated[int | None, typer.Option(help="Sequences in the running batch.")]

NumKvBlocks = Annotated[int | None, typer.Option(help="KV cache blocks (default: sized by memory).")]

Threads = Annotated[int | None, typer.Option(help="Engine CPU threads (default: torch's).")]

LoraBackend = Annotated[
    str | None, typer.Option(help="auto, native or torch (CPU), triton (CUDA): how LoRA is applied.")
]

LoraDtype = Annotated[
    str | None, typer.Option(help="Adapter pool dtype: auto (= --dtype), float32, float16 or bfloat16.")
]

Speculative = Annotated[
    str | None,
    typer.Option(help="Speculative decoding: ngram (prompt lookup) or draft:PATH (default: off)."),
]

NumSpeculativeTokens = Annotated[
    int | None, typer.Option(help="With --speculative: most tokens proposed per step (1-16).")
]

CudaGraphs = Annotated[
    bool | None,
    typer.Option(
        "--cuda-graphs/--eager",
        help="CUDA: replay plain decode steps from captured graphs (default), or run every step eagerly.",
    ),
]

TensorParallelSize = Annotated[
    int | None,
    typer.Option(
        "--tensor-parallel-size",
        "-tp",
        help="Shard the model over N ranks (vLLM's meaning): CUDA: N GPUs; CPU: N processes sharing "
        "--threads. A rank that dies or hangs restarts the engine (requests in flight get a 503).",
        min=1,
    ),
]

FullyShardedLoras = Annotated[
    bool | None,
    typer.Option(
        "--fully-sharded-loras",
        help="vLLM's flag: with --tensor-parallel-size N, LoRA A is sharded by rank too (one all-gather "
        "of the shrink output per projection; CPU only).",
    ),
]

EnableExpertParallel = Annotated[
    bool | None,
    typer.Option(
        "--enable-expert-parallel",
        help="vLLM's flag: with --tensor-parallel-size N on a mixture-of-experts model, each rank holds "
        "only its experts (whole) and their slices of every adapter; attention stays tensor-parallel.",
    ),
]

ExpertPlacement = Annotated[
    str | None,
    typer.Option(
        "--expert-placement",
        help="With --enable-expert-parallel: linear (rank r holds a contiguous range of experts, "
        "default) or round_robin (expert e on rank e % N).",
    ),
]

LogLevel = Annotated[str, typer.Option(help="uvicorn log level.")]

ShutdownGrace = Annotated[
    float | None,
    typer.Option(
        envvar="LORAPLEX_SHUTDOWN_GRACE",
        help="Seconds requests in flight get to finish on SIGTERM/Ctrl-C before they end with a "
        "retryable 503 (default 30).",
        min=0,
        max=3600,
    ),
]
