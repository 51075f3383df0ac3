"""The Ray Serve options of `loraplex serve` (`api/cli/serve.py`): engine replicas, autoscaling,
prefill/decode disaggregation, the Ray cluster and the affinity router, one type alias an option (the
command's parameter keeps its default)."""

from __future__ import annotations

from typing import Annotated

import typer

Replicas = Annotated[
    int | None,
    typer.Option(
        help="Serve with N engine replicas on Ray Serve (see --router); with --max-replicas, the "
        "number to start with.",
        min=1,
    ),
]

MinReplicas = Annotated[
    int | None,
    typer.Option(help="Autoscaling (with --max-replicas): fewest engine replicas (default 1).", min=1),
]

MaxReplicas = Annotated[
    int | None,
    typer.Option(
        help="Autoscale the engine replicas on Ray Serve up to this many (--replicas: how many to start "
        "with, default --min-replicas).",
        min=1,
    ),
]

TargetOngoingRequests = Annotated[
    float | None,
    typer.Option(
        help="Autoscaling: requests running or queued per replica that Serve aims at (default: "
        "--max-num-seqs).",
        min=0,
    ),
]

PrefillReplicas = Annotated[
    int | None,
    typer.Option(
        help="Prefill/decode disaggregation on Ray Serve: P prefill replicas (with --decode-replicas).",
        min=1,
    ),
]

DecodeReplicas = Annotated[
    int | None,
    typer.Option(help="With --prefill-replicas: D decode replicas that continue each prefill.", min=1),
]

KvTransferTimeout = Annotated[
    float | None,
    typer.Option(
        help="With --prefill-replicas: seconds a request's KV handoff (export, fetch, import) may take "
        "before it is cancelled and the request ends with the retryable 503 (default 30).",
        min=0,
    ),
]

LocalPrefillTokens = Annotated[
    int,
    typer.Option(
        help="With --prefill-replicas: prompts of at most this many tokens are prefilled by a decode "
        "replica itself, with no KV handoff (default 0: every prompt goes to a prefill replica).",
        min=0,
    ),
]

RayAddress = Annotated[
    str | None, typer.Option(help="With --replicas: join this Ray cluster (default: start a local one).")
]

RayNumCpus = Annotated[
    int | None, typer.Option(help="With --replicas: CPUs of the local Ray cluster.", min=1)
]

CpusPerReplica = Annotated[
    float,
    typer.Option(help="With --replicas: Ray CPUs each engine replica reserves (default 0).", min=0),
]

GpusPerReplica = Annotated[
    float,
    typer.Option(help="With --replicas: Ray GPUs each engine replica reserves (e.g. 1).", min=0),
]

IngressReplicas = Annotated[
    int, typer.Option(help="With --replicas: HTTP ingress replicas (default 1).", min=1)
]

WaitForNodes = Annotated[
    bool,
    typer.Option(
        help="With --replicas: start even when the Ray cluster's nodes cannot hold the engine replicas "
        "now (a Ray autoscaler adds nodes on demand); by default such a start is refused."
    ),
]

Router = Annotated[
    str,
    typer.Option(
        help="With --replicas: 'affinity' scores prefix cache, adapter residency and load (default); "
        "'multiplex' is Ray Serve's multiplexing by adapter only."
    ),
]

RouterWPrefix = Annotated[
    float, typer.Option(help="--router affinity: weight of the predicted prefix hit.", min=0)
]

RouterWAdapter = Annotated[
    float, typer.Option(help="--router affinity: weight of the adapter's residency.", min=0)
]

RouterWLoad = Annotated[float, typer.Option(help="--router affinity: weight of the replica's load.", min=0)]

RouterSpreadLoad = Annotated[
    float,
    typer.Option(
        help="--router affinity: a hot adapter spreads to one more replica once its own load (share "
        "of a replica's KV budget or max-num-seqs) reaches this on every replica it is on.",
        min=0.01,
    ),
]

RouterMaxSpread = Annotated[
    int, typer.Option(help="--router affinity: the most replicas one adapter spreads to.", min=1)
]

RouterContractAfter = Annotated[
    float,
    typer.Option(
        help="--router affinity: seconds a spread adapter's load must stay low before it leaves a replica.",
        min=0,
    ),
]

RouterMaxOngoing = Annotated[
    int | None,
    typer.Option(
        help="--router affinity: requests one engine replica takes before Ray Serve queues the rest "
        "(default 8 x --max-num-seqs: the engines' waiting queues hold the backlog, which the router's "
        "load term sees).",
        min=1,
    ),
]

RouterHoldMargin = Annotated[
    float,
    typer.Option(
        help="--router affinity: a request is offered only to replicas scored at most this below the "
        "best one; Serve holds it for them while they are full.",
        min=0,
    ),
]
