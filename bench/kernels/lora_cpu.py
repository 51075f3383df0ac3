"""CPU LoRA on the benchmark shapes: the torch path vs the native kernel (`loraplex bench kernels-cpu`).

    python -m bench.kernels.lora_cpu [--adapters 32] [--rows 64] [--threads 1 2] [--repeats 5] \
        [--json out.json]

A synthetic adapter pool holds `--adapters` random rank-16 adapters on all 7 projections of the
benchmark Llama (`bench.common.workload.ModelSpec`; nothing is read from disk). Two steps are timed through
`CpuLoRAContext.apply`, for every layer and packed projection, exactly as the engine calls it:

- decode: one row per adapter (each row reads its own pages);
- prefill: `--rows` rows per adapter (one run per adapter).

Paths: the torch backend (decode rows gathered + `bmm`, prefill runs as per-run GEMMs) and the native
kernel with float32, float16 and bfloat16 pages; each at every `--threads`, best of `--repeats`. Every
path's output is compared with the float32 torch path's. For decode the table also gives the bytes of
adapter pages one step reads and the rate the time implies, next to a plain read of 100 MB
(`torch.sum`) on this machine as the reference bandwidth.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.workload import ModelSpec, report

SLICE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# (path, page dtype, activation dtype, instruction-set level of the native kernel: None = the best)
PATHS = (
    ("torch", torch.float32, torch.float32, None),
    ("native", torch.float32, torch.float32, None),
    ("native", torch.float16, torch.float32, None),
    ("native", torch.bfloat16, torch.float32, None),
    ("torch", torch.bfloat16, torch.bfloat16, None),
    ("native", torch.bfloat16, torch.bfloat16, None),
    ("native", torch.bfloat16, torch.bfloat16, "avx2"),
)


@dataclass(slots=True)
class KernelTiming:
    step: str  # "decode" | "prefill"
    path: str  # "torch" | "native" (with the instruction-set level, e.g. "native avx2")
    dtype: str  # adapter page dtype, and "/ bfloat16 x" for bfloat16 activations
    threads: int
    ms: float
    max_abs_diff: float  # vs the float32 torch path's output
    page_bytes: int = 0  # adapter page bytes one decode step reads (decode only)

    @property
    def gb_per_s(self) -> float | None:
        return self.page_bytes / self.ms / 1e6 if self.page_bytes else None


@dataclass(slots=True)
class KernelsCpuResult:
    adapters: int
    rows: int
    read_gb_per_s: dict[int, float]  # threads -> plain torch.sum read rate
    timings: list[KernelTiming] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        lines = [
            "| step | path | pages | threads | ms per step | adapter bytes read at | max abs diff vs torch |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in self.timings:
            rate = f"{t.gb_per_s:.1f} GB/s" if t.gb_per_s else ""
            head = f"| {t.step} | {t.path} | {t.dtype} | {t.threads} | {t.ms:.2f}"
            lines.append(f"{head} | {rate} | {t.max_abs_diff:.1e} |")
        reads = ", ".join(f"{g:.1f} GB/s with {n} thread(s)" for n, g in self.read_gb_per_s.items())
        lines.append("")
        lines.append(
            f"Decode: {self.adapters} rows, each on its own adapter; prefill: {self.adapters} runs of "
            f"{self.rows} rows. Plain read of 100 MB (`torch.sum`): {reads}."
        )
        return "\n".join(lines)


def _config(spec: ModelSpec):
    from engine.model_config import ModelConfig

    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **spec.hf_config()})


def _pool(cfg, adapters: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """A pool of `adapters` random rank-`rank` adapters on all 7 projections (same weights per seed)."""
    from engine.lora import adapter_checkpoint as ac
    from engine.lora.pool import AdapterPool

    pool = AdapterPool(cfg, adapters, 16, rank, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    resident = []
    for i in range(adapters):
        mods = []
        for layer in range(cfg.num_layers):
            for m in ac.PROJECTIONS:
                fin, fout = ac.module_features(cfg, m)
                a = torch.randn(rank, fin, generator=gen) / fin**0.5
                b = torch.randn(fout, rank, generator=gen) * 0.01
                mods.append(ac.LoRAModuleWeights(layer, m, rank, 2.0 * rank, 2.0, a, b))
        ckpt = ac.AdapterCheckpoint(f"a{i}", rank, 2.0 * rank, ac.PROJECTIONS, False, 0, None, tuple(mods))
        resident.append(pool.upload(ckpt))
    return pool, resident


def _time_step(ctx, cfg, xs: dict, ys: dict, repeats: int) -> float:
    """Best wall time (ms) of applying `ctx` to every layer and packed projection."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up (and builds nothing: plans are built already)
        t0 = time.perf_counter()
        for layer in range(cfg.num_layers):
            for group in SLICE_GROUPS:
                ctx.apply(layer, group, xs[group], ys[group])
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _read_rate(threads: int) -> float:
    torch.set_num_threads(threads)
    t = torch.ones(25_000_000)
    t.sum()
    start = time.perf_counter()
    for _ in range(5):
        t.sum()
    return t.numel() * 4 * 5 / (time.perf_counter() - start) / 1e9


def run_kernels_cpu(
    adapters: int = 32,
    rows: int = 64,
    threads: tuple[int, ...] = (1, 2),
    repeats: int = 5,
    spec: ModelSpec | None = None,
    rank: int = 16,
) -> KernelsCpuResult:
    """Time the CPU LoRA paths on one decode and one prefill step (see the module docstring)."""
    from engine.lora.adapter_checkpoint import module_features
    from engine.lora.step_context import CpuLoRAContext, token_segments
    from kernels.lora_bgmv_cpu import available_isas, best_isa, use_isa

    cfg = _config(spec or ModelSpec())
    prev = torch.get_num_threads()
    result = KernelsCpuResult(adapters, rows, {n: _read_rate(n) for n in threads})
    try:
        for step, per in (("decode", 1), ("prefill", rows)):
            gen = torch.Generator().manual_seed(1)
            n_rows = adapters * per
            xs = {g: torch.randn(n_rows, module_features(cfg, g[0])[0], generator=gen) for g in SLICE_GROUPS}
            width = {g: sum(module_features(cfg, m)[1] for m in g) for g in SLICE_GROUPS}
            reference = None
            for path, dtype, act, isa in PATHS:
                if path == "native" and isa is not None and isa not in available_isas():
                    continue
                use_isa(isa if path == "native" else None)
                pool, resident = _pool(cfg, adapters, rank, dtype)
                page_bytes = adapters * sum(t[0].numel() * t.element_size() for t in (*pool.a, *pool.b))
                for n in threads:
                    torch.set_num_threads(n)
                    ctx = CpuLoRAContext(
                        pool, token_segments([per] * adapters, resident), native=path == "native"
                    )
                    x_act = {g: x.to(act) for g, x in xs.items()}
                    ys = {g: torch.zeros(n_rows, width[g], dtype=act) for g in SLICE_GROUPS}
                    for layer in range(cfg.num_layers):  # one pass for the outputs
                        for g in SLICE_GROUPS:
                            ctx.apply(layer, g, x_act[g], ys[g])
                    out = torch.cat([ys[g] for g in SLICE_GROUPS], dim=1).float()
                    reference = out if reference is None else reference
                    zeros = {g: torch.zeros_like(ys[g]) for g in SLICE_GROUPS}
                    ms = _time_step(ctx, cfg, x_act, zeros, repeats)
                    diff = float((out - reference).abs().max())
                    name = str(dtype).removeprefix("torch.")
                    if act != torch.float32:
                        name += f" / {str(act).removeprefix('torch.')} x"
                    label = path if path == "torch" else f"native {isa or best_isa()}"
                    read = page_bytes if step == "decode" else 0
                    result.timings.append(KernelTiming(step, label, name, n, ms, diff, read))
    finally:
        torch.set_num_threads(prev)
        use_isa(None)
    return result


def main(argv: list[str] | None = None) -> KernelsCpuResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rows", type=int, default=64, help="prefill rows per adapter")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = run_kernels_cpu(args.adapters, args.rows, tuple(args.threads), args.repeats)
    return report(result, args.json, None, None)


if __name__ == "__main__":
    main()
