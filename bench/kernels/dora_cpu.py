"""DoRA vs plain LoRA on the CPU: what the DoRA epilogue adds to a step's projections.

    python -m bench.kernels.dora_cpu [--adapters 32] [--prefill-rows 16] [--repeats 15] [--threads 1]

Two synthetic pools on the benchmark Llama (`bench.common.workload.ModelSpec`, random weights, nothing
read from disk), each with `--adapters` rank-16 adapters on all 7 projections: plain LoRA, and the same
adapters with DoRA magnitudes. For a decode step (one row per adapter) and a prefill step
(`--prefill-rows` rows per adapter) it times, for every layer and packed projection as the engine calls
them, the base projection plus `CpuLoRAContext.apply` (native kernel), plain vs DoRA, and the DoRA
epilogue alone. Timings alternate between the two pools and take the best of `--repeats`, which keeps a
shared machine's noise out of the ratio as far as possible.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.common.workload import ModelSpec
from bench.kernels.lora_cpu import SLICE_GROUPS, _config
from engine.lora import adapter_checkpoint as ac
from engine.lora.pool import MODULE_INDEX, AdapterPool, ResidentAdapter
from engine.lora.step_context import CpuLoRAContext, token_segments


class _RandomBase:
    """`BaseWeights` of random dense projections (no bias), per (layer, slice)."""

    def __init__(self, cfg, gen: torch.Generator) -> None:
        self.w = {}
        for layer in range(cfg.num_layers):
            for m in ac.PROJECTIONS:
                fin, fout = ac.module_features(cfg, m)
                self.w[(layer, m)] = torch.randn(fout, fin, generator=gen) * 0.05

    def row_sq_norms(self, layer: int, module: str) -> torch.Tensor:
        return self.w[(layer, module)].pow(2).sum(1)

    def times_weight_t(self, layer: int, module: str, a: torch.Tensor) -> torch.Tensor:
        return a @ self.w[(layer, module)].T

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        return None


def _pool(cfg, n: int, rank: int, dora: bool, base: _RandomBase) -> tuple[AdapterPool, list[ResidentAdapter]]:
    pool = AdapterPool(cfg, n, 16, rank, torch.float32, torch.device("cpu"), base)
    gen = torch.Generator().manual_seed(0)  # the same A and B in both pools
    resident = []
    for i in range(n):
        mods = []
        for layer in range(cfg.num_layers):
            for m in ac.PROJECTIONS:
                fin, fout = ac.module_features(cfg, m)
                a = torch.randn(rank, fin, generator=gen) / fin**0.5
                b = torch.randn(fout, rank, generator=gen) * 0.01
                mag = torch.rand(fout, generator=gen) + 0.5
                mods.append(ac.LoRAModuleWeights(layer, m, rank, 32.0, 2.0, a, b, mag if dora else None))
        ckpt = ac.AdapterCheckpoint(
            f"a{i}", rank, 32.0, ac.PROJECTIONS, False, 0, None, tuple(mods), use_dora=dora
        )
        resident.append(pool.upload(ckpt))
    return pool, resident


def _best_of(fns: list[Callable[[], None]], repeats: int) -> list[float]:
    """Best wall time (ms) of each function, calls interleaved."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats + 1):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def run(
    adapters: int = 32,
    prefill_rows: int = 16,
    repeats: int = 15,
    rank: int = 16,
    spec: ModelSpec | None = None,
) -> list[str]:
    """One line per step: projections + LoRA, plain vs DoRA (ms, ratio), and the epilogue alone."""
    cfg = _config(spec or ModelSpec())
    gen = torch.Generator().manual_seed(1)
    base = _RandomBase(cfg, gen)
    pools = {dora: _pool(cfg, adapters, rank, dora, base) for dora in (False, True)}
    packed = {  # each packed projection's base weight (q|k|v, gate|up), as the engine holds it
        (layer, g): torch.cat([base.w[(layer, m)] for m in g])
        for layer in range(cfg.num_layers)
        for g in SLICE_GROUPS
    }
    lines = []
    for step, per in (("decode", 1), ("prefill", prefill_rows)):
        rows = adapters * per
        xs = {g: torch.randn(rows, ac.module_features(cfg, g[0])[0], generator=gen) for g in SLICE_GROUPS}
        ctxs = {
            d: CpuLoRAContext(p, token_segments([per] * adapters, r), native=True)
            for d, (p, r) in pools.items()
        }

        def step_fn(ctx: CpuLoRAContext, xs: dict = xs) -> Callable[[], None]:
            def fn() -> None:
                for layer in range(cfg.num_layers):
                    for g in SLICE_GROUPS:
                        ctx.apply(layer, g, xs[g], torch.nn.functional.linear(xs[g], packed[(layer, g)]))

            return fn

        ys = {g: torch.zeros(rows, sum(ac.module_features(cfg, m)[1] for m in g)) for g in SLICE_GROUPS}

        def epilogue(ctxs: dict = ctxs, ys: dict = ys) -> None:
            for layer in range(cfg.num_layers):
                for g in SLICE_GROUPS:
                    first = MODULE_INDEX[g[0]]
                    ctxs[True].epilogue.apply(layer, range(first, first + len(g)), ys[g])

        plain, dora, epi = _best_of([step_fn(ctxs[False]), step_fn(ctxs[True]), epilogue], repeats)
        lines.append(
            f"{step}: {rows} rows, {adapters} adapters: projections + LoRA plain {plain:.2f} ms, "
            f"DoRA {dora:.2f} ms ({dora / plain:.2f}x); DoRA epilogue alone {epi:.2f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--prefill-rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden-size", type=int, default=ModelSpec().hidden_size)
    ap.add_argument("--intermediate-size", type=int, default=ModelSpec().intermediate_size)
    ap.add_argument("--layers", type=int, default=ModelSpec().num_layers)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = ModelSpec(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size, num_layers=args.layers
    )
    lines = run(args.adapters, args.prefill_rows, args.repeats, spec=spec)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
