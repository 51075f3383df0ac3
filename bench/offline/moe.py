"""MoE vs dense decode: a random Qwen3-MoE-shaped model beside a dense Qwen3 with the same *active*
parameters (its MLP as wide as the k experts a token runs), in one run::

    python -m bench.offline.moe [--layers 8 --experts 32 --top-k 4 --hidden 512 --expert-inter 256] \\
        [--batches 1,8,32] [--new-tokens 24] [--runs 5] [--threads 0] [--dtype float32] [--moe-block] \\
        [--json OUT]

Both models are built here with transformers' own configs (random weights, nothing downloaded). Per batch
size four legs decode the same prompts, interleaved, `--runs` times after a warm-up: the MoE model on the
engine's CPU expert path (`engine/model/moe_experts.py`: decode steps' routing and experts as one native
call, `kernels/moe_fused_cpu.py`), the same op by op (`FUSED_DECODE = False`: torch routing and sort, the
native streaming GEMMs), the same with torch's grouped GEMM (`NATIVE_MAX_ROWS = 0`, the path before
both), and the dense model. Figures: each leg's mean decode-step time per run (median and min-max
over the runs), the ratios MoE / dense per run (issue 28's goal: <= 1.3x; median and min-max), beside the
ratio of weight bytes a step reads (a batch reads the union of its rows' experts) -- what the step would
cost if it followed the bytes it must read. `--moe-block` times the MoE block alone (both paths) against
the dense MLP on decode-sized inputs. The load average (`os.getloadavg`) is recorded before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.workload import bench_env, make_prompts, report, timed_run

# the engine's MoE path; op by op (no fused call); op by op with torch's GEMMs; dense
LEGS = ("moe", "moe_unfused", "moe_torch", "dense")


@dataclass(frozen=True, slots=True)
class MoEShape:
    """The random models' shape (defaults: a scaled-down Qwen3-30B-A3B: 8 layers, 32 experts, top-4)."""

    layers: int = 8
    experts: int = 32
    top_k: int = 4
    hidden: int = 512
    expert_inter: int = 256
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 4096

    def common(self) -> dict:
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                    head_dim=self.hidden // self.heads, max_position_embeddings=512,
                    tie_word_embeddings=False)  # fmt: skip

    def active_params(self, moe: bool) -> int:
        """Parameters one decode token reads: attention, the MLP it runs (k experts + router, or the dense
        MLP of width k * expert_inter), norms, embedding row excluded, LM head included."""
        hd = self.hidden // self.heads
        attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads) + 2 * hd
        mlp = 3 * self.hidden * self.top_k * self.expert_inter + (self.experts * self.hidden if moe else 0)
        return self.layers * (attn + mlp + 2 * self.hidden) + self.hidden + self.vocab * self.hidden

    def step_bytes_ratio(self, batch: int) -> float:
        """MoE / dense weight bytes one decode step of `batch` rows reads, routing uniform: a layer reads
        the union of its rows' experts, E * (1 - (1 - k/E)^batch) of them on average."""
        distinct = self.experts * (1 - (1 - self.top_k / self.experts) ** batch)
        dense = self.active_params(False)
        return (dense + self.layers * (3 * self.hidden * self.expert_inter * (distinct - self.top_k)
                                       + self.experts * self.hidden)) / dense  # fmt: skip

    def total_params(self, moe: bool) -> int:
        """All parameters (the MoE's experts that no token runs included)."""
        extra = self.layers * 3 * self.hidden * self.expert_inter * (self.experts - self.top_k) if moe else 0
        return self.active_params(moe) + extra + self.vocab * self.hidden


def build_models(root: Path, shape: MoEShape, seed: int = 0) -> tuple[Path, Path]:
    """(Qwen3-MoE dir, dense Qwen3 dir) with random weights (std 0.02, transformers' init)."""
    import transformers as tf

    torch.manual_seed(seed)
    moe_dir, dense_dir = root / "moe", root / "dense"
    if not (moe_dir / "config.json").exists():
        cfg = tf.Qwen3MoeConfig(**shape.common(), intermediate_size=shape.top_k * shape.expert_inter,
                                moe_intermediate_size=shape.expert_inter, num_experts=shape.experts,
                                num_experts_per_tok=shape.top_k, norm_topk_prob=True)  # fmt: skip
        tf.Qwen3MoeForCausalLM(cfg).save_pretrained(moe_dir)
    if not (dense_dir / "config.json").exists():
        cfg = tf.Qwen3Config(**shape.common(), intermediate_size=shape.top_k * shape.expert_inter)
        tf.Qwen3ForCausalLM(cfg).save_pretrained(dense_dir)
    return moe_dir, dense_dir


def spread(values: list[float]) -> dict:
    """median, min and max of `values`."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cell(values: list[float], unit: str = " ms", digits: int = 2) -> str:
    m = spread(values)
    return f"{m['median']:.{digits}f}{unit} ({m['min']:.{digits}f}–{m['max']:.{digits}f})"


@dataclass(slots=True)
class DecodePoint:
    """Per leg (`LEGS`), the mean decode-step time of each run, ms."""

    batch: int
    step_ms: dict[str, list[float]]

    def ratios(self, leg: str, over: str = "dense") -> list[float]:
        """`leg` / `over` per run."""
        return [a / b for a, b in zip(self.step_ms[leg], self.step_ms[over], strict=True)]


@dataclass(slots=True)
class BlockPoint:
    """The MoE block alone (each MoE leg's path) vs the dense MLP on `rows` decode rows, all layers,
    ms per call of each of `runs` interleaved rounds."""

    rows: int
    block_ms: dict[str, list[float]]


@dataclass(slots=True)
class MoEBenchResult:
    shape: dict
    device: str
    dtype: str
    threads: int
    runs: int
    active_params: dict
    total_params: dict
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    points: list[DecodePoint] = field(default_factory=list)
    blocks: list[BlockPoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, src in zip(d["points"], self.points, strict=True):
            p["summary"] = {leg: spread(v) for leg, v in src.step_ms.items()}
            p["ratio_moe_dense"] = spread(src.ratios("moe"))
            p["ratio_unfused_dense"] = spread(src.ratios("moe_unfused"))
            p["ratio_torch_dense"] = spread(src.ratios("moe_torch"))
            p["speedup_fused"] = spread(src.ratios("moe_unfused", "moe"))
            p["speedup_native"] = spread(src.ratios("moe_torch", "moe"))
        return d

    def markdown(self) -> str:
        s, shape = self.shape, MoEShape(**self.shape)
        load = (
            "/".join(f"{v:.1f}" for v in self.load_before)
            + " -> "
            + "/".join(f"{v:.1f}" for v in self.load_after)
        )
        lines = [
            f"MoE: {s['layers']} layers, {s['experts']} experts, top-{s['top_k']}, hidden {s['hidden']}, "
            f"expert inter {s['expert_inter']}; dense: inter {s['top_k'] * s['expert_inter']} "
            f"({self.device}, {self.dtype}, threads {self.threads}, {self.runs} runs, load {load})",
            f"active params: MoE {self.active_params['moe'] / 1e6:.2f} M, dense "
            f"{self.active_params['dense'] / 1e6:.2f} M; total: MoE {self.total_params['moe'] / 1e6:.1f} M",
            "",
            "| decode batch | MoE step | MoE step, op by op | MoE step, torch GEMMs | dense step "
            "| MoE / dense | op by op / dense | torch GEMMs / dense | native speed-up "
            "| weight bytes MoE / dense |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in self.points:
            cells = [_cell(p.step_ms[leg]) for leg in LEGS]
            cells += [_cell(p.ratios(leg), "x") for leg in LEGS[:3]]
            cells += [_cell(p.ratios("moe_torch", "moe"), "x"), f"{shape.step_bytes_ratio(p.batch):.2f}x"]
            lines.append(f"| {p.batch} | " + " | ".join(cells) + " |")
        if self.blocks:
            head = ("| rows | MoE block | MoE block, op by op | MoE block, torch GEMMs | dense MLP "
                    "| block / dense | op by op / dense | torch / dense |")  # fmt: skip
            lines += ["", head, "|---|---|---|---|---|---|---|---|"]
            for b in self.blocks:
                ratio = [
                    [m / d for m, d in zip(b.block_ms[leg], b.block_ms["dense"], strict=True)]
                    for leg in LEGS[:3]
                ]
                cells = [_cell(b.block_ms[leg]) for leg in LEGS] + [_cell(r, "x") for r in ratio]
                lines.append(f"| {b.rows} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


@contextlib.contextmanager
def torch_gemms(on: bool) -> Iterator[None]:
    """With `on`, the CPU expert path without its native kernels inside: neither the streaming GEMMs
    (`NATIVE_MAX_ROWS = 0`) nor the fused decode call (`FUSED_DECODE = False`)."""
    from engine.model import moe_experts

    prev = moe_experts.NATIVE_MAX_ROWS, moe_experts.FUSED_DECODE
    if on:
        moe_experts.NATIVE_MAX_ROWS, moe_experts.FUSED_DECODE = 0, False
    try:
        yield
    finally:
        moe_experts.NATIVE_MAX_ROWS, moe_experts.FUSED_DECODE = prev


@contextlib.contextmanager
def op_by_op(on: bool) -> Iterator[None]:
    """With `on`, the CPU expert path without its fused decode call (`FUSED_DECODE = False`) inside."""
    from engine.model import moe_experts

    prev = moe_experts.FUSED_DECODE
    moe_experts.FUSED_DECODE = not on and prev
    try:
        yield
    finally:
        moe_experts.FUSED_DECODE = prev


@contextlib.contextmanager
def leg_path(leg: str) -> Iterator[None]:
    """The MoE expert path of `leg` (`LEGS`) inside."""
    with torch_gemms(leg == "moe_torch"), op_by_op(leg == "moe_unfused"):
        yield


def _engine(model: Path, device: str, dtype: str, batch: int):
    from engine import LLM

    llm = LLM(str(model), device=device, dtype=dtype, enable_lora=False, max_num_seqs=max(batch, 1),
              enable_prefix_caching=False)  # fmt: skip
    return llm.engine


def _decode_ms(engine, prompts, new_tokens: int, tag: str) -> float:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    run = timed_run(engine, prompts, params, None, tag)
    return 1e3 * run.decode_s / max(run.decode_steps, 1)


def _block_ms(moe_model, dense_model, rows: int, runs: int, repeats: int = 5) -> BlockPoint:
    """Every layer's MoE block (each MoE leg's path) vs every layer's dense MLP on the same random input, runs
    interleaved; each figure the mean of `repeats` calls."""
    from engine.model.moe import SparseMoE

    moe_blocks = [m for m in moe_model.modules() if isinstance(m, SparseMoE)]
    mlps = [layer.mlp for layer in dense_model.layers]
    p = next(moe_model.parameters())
    x = torch.randn(rows, moe_blocks[0].gate.weight.shape[1], dtype=p.dtype, device=p.device) * 0.5
    legs = {
        "moe": lambda: [b(x) for b in moe_blocks],
        "moe_unfused": lambda: [b(x) for b in moe_blocks],
        "moe_torch": lambda: [b(x) for b in moe_blocks],
        "dense": lambda: [m(x, None) for m in mlps],
    }
    out = BlockPoint(rows, {leg: [] for leg in LEGS})
    with torch.no_grad():
        with torch_gemms(True):
            want = [b(x) for b in moe_blocks]
        tol = 1e-3 if p.dtype == torch.float32 else 3e-2  # bfloat16: the paths round at other points
        for leg in LEGS[:2]:  # every path computes one block
            with leg_path(leg):
                for b, w in zip(moe_blocks, want, strict=True):
                    torch.testing.assert_close(b(x), w, rtol=tol, atol=tol)
        for r in range(runs + 1):
            for leg, fn in legs.items():
                with leg_path(leg):
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        fn()
                    if p.device.type == "cuda":
                        torch.cuda.synchronize()
                    if r:
                        out.block_ms[leg].append(1e3 * (time.perf_counter() - t0) / repeats)
    return out


def run_moe_bench(workdir: Path, shape: MoEShape = MoEShape(), batches=(1, 8, 32), new_tokens: int = 24,
                  runs: int = 5, device: str = "cpu", dtype: str = "float32", moe_block: bool = False,
                  prompt_len: int = 16) -> MoEBenchResult:  # fmt: skip
    """Decode step time of the four legs (`LEGS`) per batch size, interleaved, `runs` runs each."""
    moe_dir, dense_dir = build_models(workdir, shape)
    active = {"moe": shape.active_params(True), "dense": shape.active_params(False)}
    total = {"moe": shape.total_params(True), "dense": shape.total_params(False)}
    result = MoEBenchResult(asdict(shape), device, dtype, torch.get_num_threads(), runs, active, total,
                            list(os.getloadavg()))  # fmt: skip
    for batch in batches:
        engines = {
            "moe": _engine(moe_dir, device, dtype, batch),
            "dense": _engine(dense_dir, device, dtype, batch),
        }
        engines["moe_torch"] = engines["moe_unfused"] = engines["moe"]
        prompts = make_prompts(batch, prompt_len, shape.vocab)
        point = DecodePoint(batch, {leg: [] for leg in LEGS})
        for r in range(runs + 1):  # run 0 warms up
            for leg in LEGS:
                with leg_path(leg):
                    ms = _decode_ms(engines[leg], prompts, new_tokens, f"{leg}-{batch}-{r}")
                if r > 0:
                    point.step_ms[leg].append(ms)
        result.points.append(point)
        if moe_block:
            result.blocks.append(_block_ms(engines["moe"].model, engines["dense"].model, batch, runs))
        del engines
    result.load_after = list(os.getloadavg())
    return result


def main(argv: list[str] | None = None) -> MoEBenchResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = MoEShape()
    for name in ("layers", "experts", "top_k", "hidden", "expert_inter", "heads", "kv_heads", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument(
        "--runs", "--rounds", type=int, default=5, help="interleaved runs per leg (after a warm-up)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--moe-block", action="store_true", help="also time the MoE block vs the dense MLP")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the models here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    shape = MoEShape(*(getattr(args, n) for n in ("layers", "experts", "top_k", "hidden", "expert_inter",
                                                  "heads", "kv_heads", "vocab")))  # fmt: skip
    with bench_env(args.threads, args.workdir) as work:
        batches = tuple(int(b) for b in args.batches.split(","))
        result = run_moe_bench(work, shape, batches, args.new_tokens, args.runs, args.device, args.dtype,
                               args.moe_block, args.prompt_len)  # fmt: skip
    report(result, args.json, None, None)
    return result


if __name__ == "__main__":
    main()
