"""`loraplex bench …`: the benchmarks in `bench/`, each with its own flags (`--help` lists them).

Results are printed as markdown tables; copy them with their command into docs/benchmarks.md.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="Run benchmarks (not tests); ratios are measured in one run.", no_args_is_help=True)

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

# command -> (module, description)
BENCHMARKS = {
    "offline": (
        "bench.offline.throughput",
        "Offline mixed-adapter throughput vs base, HF PEFT and the GEMM limit.",
    ),
    "scaling": ("bench.offline.scaling", "Throughput and pool hit rate vs number of distinct adapters."),
    "cold-load": (
        "bench.offline.cold_load",
        "Cold adapter load: first-token latency and the running batch's steps.",
    ),
    "serve": (
        "bench.serving.online",
        "Online serving: Poisson arrivals, power-law adapter popularity, TTFT/TPOT.",
    ),
    "cluster": (
        "bench.cluster.affinity",
        "Ray Serve replicas, one trace above their capacity: prefix hits, adapter loads, throughput and "
        "TTFT per router (pow2, multiplex, Ray's prefix router, affinity).",
    ),
    "disagg": (
        "bench.cluster.disagg",
        "Prefill/decode disaggregation vs colocated replicas on the same cores: ITL, TTFT, throughput.",
    ),
    "kernels-cpu": (
        "bench.kernels.lora_cpu",
        "CPU LoRA: torch path vs native kernel, one decode and one prefill step.",
    ),
    "accounting": (
        "bench.serving.accounting",
        "Per-request cost of rate limiting (in-process, Redis) and usage recording.",
    ),
    "structured": (
        "bench.structured.grammar_mask",
        "Structured output on CPU: per-token grammar mask cost of llguidance, xgrammar, outlines-core.",
    ),
    "peer": (
        "bench.peer.offline",
        "loraplex vs vLLM CPU on the identical workload (needs make bench-peer-venv).",
    ),
    "serve-peer": (
        "bench.peer.online",
        "Online serving, loraplex vs vLLM CPU's OpenAI server: the same Poisson workload, p99 TTFT bound.",
    ),
}


def _command(module: str):
    def run(ctx: typer.Context) -> None:
        importlib.import_module(module).main(list(ctx.args))

    return run


for _name, (_module, _doc) in BENCHMARKS.items():
    app.command(_name, help=_doc + " Flags go to the benchmark; try --help.", context_settings=_PASS_THROUGH)(
        _command(_module)
    )
