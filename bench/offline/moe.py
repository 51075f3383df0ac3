"""MoE vs dense decode: a random Qwen3-MoE-shaped model beside a dense Qwen3 with the same *active*
parameters (its MLP as wide as the k experts a token runs), in one run::

    python -m bench.offline.moe [--layers 8 --experts 32 --top-k 4 --hidden 512 --expert-inter 256] \\
        [--batches 1,8,32] [--new-tokens 24] [--rounds 3] [--threads 0] [--device cpu] [--json OUT]

Both models are built here with transformers' own configs (random weights, nothing downloaded). Per batch
size the two engines decode the same prompts alternately, `--rounds` times; the figure is each leg's best
mean decode-step time (`bench.common.workload.timed_run`), and the ratio MoE / dense (issue 28's goal:
<= 1.3x), beside the ratio of weight bytes a step reads (a batch reads the union of its rows'
experts). `--moe-block` adds the MoE block alone against the dense MLP on decode-sized inputs (the
routed experts through the engine's `SparseMoE`, by `torch._grouped_mm`, and with experts of 2-4 rows
as `W_e @ seg.T`): where the CPU path's time goes, and two candidate formulations of it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.workload import bench_env, make_prompts, timed_run


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


@dataclass(slots=True)
class DecodePoint:
    batch: int
    moe_step_ms: float
    dense_step_ms: float

    @property
    def ratio(self) -> float:
        return self.moe_step_ms / self.dense_step_ms


@dataclass(slots=True)
class BlockPoint:
    """The MoE block alone vs the dense MLP on `rows` decode rows (best of N, ms, all layers): the
    engine's block (`SparseMoE`), the same routed experts by `torch._grouped_mm` (`grouped_experts`) and
    with small segments streamed (`streamed_experts`)."""

    rows: int
    moe_block_ms: float
    grouped_mm_ms: float
    streamed_ms: float
    dense_mlp_ms: float


@dataclass(slots=True)
class MoEBenchResult:
    shape: dict
    device: str
    dtype: str
    threads: int
    active_params: dict
    total_params: dict
    points: list[DecodePoint] = field(default_factory=list)
    blocks: list[BlockPoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, src in zip(d["points"], self.points, strict=True):
            p["ratio"] = src.ratio
        return d

    def markdown(self) -> str:
        s = self.shape
        lines = [
            f"MoE: {s['layers']} layers, {s['experts']} experts, top-{s['top_k']}, hidden {s['hidden']}, "
            f"expert inter {s['expert_inter']}; dense: inter {s['top_k'] * s['expert_inter']} "
            f"({self.device}, {self.dtype}, threads {self.threads})",
            f"active params: MoE {self.active_params['moe'] / 1e6:.2f} M, dense "
            f"{self.active_params['dense'] / 1e6:.2f} M; total: MoE {self.total_params['moe'] / 1e6:.1f} M",
            "",
            "| decode batch | MoE step | dense step | MoE / dense | weight bytes MoE / dense |",
            "|---|---|---|---|---|",
        ]
        shape = MoEShape(**self.shape)
        lines += [f"| {p.batch} | {p.moe_step_ms:.2f} ms | {p.dense_step_ms:.2f} ms | {p.ratio:.2f}x | "
                  f"{shape.step_bytes_ratio(p.batch):.2f}x |" for p in self.points]  # fmt: skip
        if self.blocks:
            head = (
                "| rows | MoE block | by grouped_mm | streamed small segments | dense MLP | block / dense |"
            )
            lines += ["", head + " grouped / dense | streamed / dense |", "|---|---|---|---|---|---|---|---|"]
            for b in self.blocks:
                moe = (b.moe_block_ms, b.grouped_mm_ms, b.streamed_ms)
                cells = [f"{v:.2f} ms" for v in (*moe, b.dense_mlp_ms)]
                cells += [f"{v / b.dense_mlp_ms:.2f}x" for v in moe]
                lines.append(f"| {b.rows} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


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


def grouped_experts(moe, x: torch.Tensor) -> torch.Tensor:
    """`SparseMoE`'s output (routed experts, no shared expert) as one `torch._grouped_mm` per projection
    over the pairs sorted by expert, instead of a Python loop over the experts: a candidate CPU path."""
    weights, ids = moe.route(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // moe.top_k
    offs = torch.cumsum(torch.bincount(flat, minlength=moe.experts.num_experts), 0).to(torch.int32)
    gu = torch._grouped_mm(x[tokens], moe.experts.gate_up.transpose(1, 2), offs=offs)
    inter = moe.experts.inter
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    ys = torch._grouped_mm(h, moe.experts.down.transpose(1, 2), offs=offs)
    ys.mul_(weights.reshape(-1)[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def streamed_experts(moe, x: torch.Tensor, max_rows: int = 4) -> torch.Tensor:
    """`SparseMoE`'s routed output with the engine's loop, but an expert with at most `max_rows` rows
    computed as `(W_e @ seg.T).T`: the GEMM library then streams W_e once (a GEMV-like kernel) instead
    of re-blocking it inside `F.linear`, which at 2-4 rows costs more than the multiply."""
    weights, ids = moe.route(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // moe.top_k
    counts = torch.bincount(flat, minlength=moe.experts.num_experts).tolist()
    xs = x[tokens]
    ys = torch.empty_like(xs)
    inter, start = moe.experts.inter, 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg, w_gu, w_d = xs[start : start + n], moe.experts.gate_up[e], moe.experts.down[e]
        small = 1 < n <= max_rows
        gu = (w_gu @ seg.T).T if small else torch.nn.functional.linear(seg, w_gu)
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        ys[start : start + n] = (w_d @ h.T).T if small else torch.nn.functional.linear(h, w_d)
        start += n
    ys.mul_(weights.reshape(-1)[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def _block_ms(moe_model, dense_model, rows: int, repeats: int) -> BlockPoint:
    """Every layer's MoE block vs every layer's dense MLP on the same random `rows` x `hidden` input."""
    from engine.model.moe import SparseMoE

    moe_blocks = [m for m in moe_model.modules() if isinstance(m, SparseMoE)]
    mlps = [layer.mlp for layer in dense_model.layers]
    p = next(moe_model.parameters())
    x = torch.randn(rows, moe_blocks[0].gate.weight.shape[1], dtype=p.dtype, device=p.device) * 0.5

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            if p.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    with torch.no_grad():
        for b in moe_blocks:  # the candidates compute what the block computes
            torch.testing.assert_close(grouped_experts(b, x), b(x), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(streamed_experts(b, x), b(x), rtol=1e-4, atol=1e-4)
        moe_ms = best(lambda: [b(x) for b in moe_blocks])
        grouped_ms = best(lambda: [grouped_experts(b, x) for b in moe_blocks])
        streamed_ms = best(lambda: [streamed_experts(b, x) for b in moe_blocks])
        dense_ms = best(lambda: [m(x, None) for m in mlps])
    return BlockPoint(rows, moe_ms, grouped_ms, streamed_ms, dense_ms)


def run_moe_bench(workdir: Path, shape: MoEShape = MoEShape(), batches=(1, 8, 32), new_tokens: int = 24,
                  rounds: int = 3, device: str = "cpu", dtype: str = "float32", threads: int = 0,
                  moe_block: bool = False, prompt_len: int = 16) -> MoEBenchResult:  # fmt: skip
    """Decode step time of the MoE model and the dense model per batch size, legs interleaved."""
    moe_dir, dense_dir = build_models(workdir, shape)
    active = {"moe": shape.active_params(True), "dense": shape.active_params(False)}
    total = {"moe": shape.total_params(True), "dense": shape.total_params(False)}
    result = MoEBenchResult(asdict(shape), device, dtype, torch.get_num_threads(), active, total)
    for batch in batches:
        engines = {
            name: _engine(d, device, dtype, batch) for name, d in (("moe", moe_dir), ("dense", dense_dir))
        }
        prompts = make_prompts(batch, prompt_len, shape.vocab)
        best = {k: float("inf") for k in engines}
        for r in range(rounds + 1):  # round 0 warms up
            for name, eng in engines.items():
                ms = _decode_ms(eng, prompts, new_tokens, f"{name}-{batch}-{r}")
                if r > 0:
                    best[name] = min(best[name], ms)
        result.points.append(DecodePoint(batch, best["moe"], best["dense"]))
        if moe_block:
            result.blocks.append(_block_ms(engines["moe"].model, engines["dense"].model, batch, 20))
        del engines
    return result


def main(argv: list[str] | None = None) -> MoEBenchResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = MoEShape()
    for name in ("layers", "experts", "top_k", "hidden", "expert_inter", "heads", "kv_heads", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--moe-block", action="store_true", help="also time the MoE block vs the dense MLP")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the models here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = MoEShape(*(getattr(args, n) for n in ("layers", "experts", "top_k", "hidden", "expert_inter",
                                                  "heads", "kv_heads", "vocab")))  # fmt: skip
    with bench_env(args.threads, args.workdir) as work:
        result = run_moe_bench(work, shape, tuple(int(b) for b in args.batches.split(",")), args.new_tokens,
                               args.rounds, args.device, args.dtype, args.threads, args.moe_block,
                               args.prompt_len)  # fmt: skip
    print(result.markdown())
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=2))
    return result


if __name__ == "__main__":
    main()
