"""MoE decode steps from CUDA graphs: tokens and step time, graphs on vs off (the GPU check's `moe` step).

    python -m bench.gpu.moe_graphs --device cuda --json moe_graphs.json

A random Qwen3-MoE (`bench.offline.moe.MoEShape`, scaled down by default: 4 layers, 16 experts, top-4)
in float32 on `--device`: transformers' greedy tokens for `--prompts` prompts, then the engine's with CUDA
graphs on (the default on CUDA: plain decode steps replay a captured graph, the routed experts the Triton
fused-MoE kernel) and off. Reported: how many graphs were captured, whether each leg's tokens equal
transformers', and the decode time of a `--batch`-request run on each leg (graphs / eager). Exit code 1
when any leg's tokens differ. On a CPU the "graphs" leg captures none (the engine enables graphs on CUDA
only): the run then only checks the script's own paths.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.common.workload import make_prompts
from bench.offline.moe import MoEShape, build_models


@dataclass(slots=True)
class MoEGraphLeg:
    cuda_graphs: bool
    graphs_captured: int
    tokens_equal_hf: bool
    decode_s: float  # the timed run's wall time


@dataclass(slots=True)
class MoEGraphResult:
    device: str
    shape: dict
    prompts: int
    new_tokens: int
    batch: int
    legs: list[MoEGraphLeg]

    def markdown(self) -> str:
        rows = [
            "| leg | graphs captured | greedy tokens = transformers | decode run (s) |",
            "|---|---|---|---|",
        ]
        for leg in self.legs:
            name = "graphs" if leg.cuda_graphs else "eager"
            rows.append(f"| {name} | {leg.graphs_captured} | {leg.tokens_equal_hf} | {leg.decode_s:.3f} |")
        on, off = (next(x for x in self.legs if x.cuda_graphs is g) for g in (True, False))
        rows.append(f"| graphs / eager | | | {on.decode_s / off.decode_s:.2f}x |")
        return "\n".join(rows)


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (float32, one prompt at a time: no padding)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(gen[0, len(p) :].tolist())
    del model
    return out


def run_leg(
    model_dir: Path, device: str, cuda_graphs: bool, prompts, want, batch: int, new_tokens: int, decode: int
) -> MoEGraphLeg:
    """One engine with graphs on or off: its greedy tokens against `want`, then a timed run of `batch`
    requests of `decode` tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, dtype="float32", cuda_graphs=cuda_graphs, max_num_seqs=batch,
              kv_cache_memory_bytes=1 << 30)  # fmt: skip
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    graphs = llm.engine.runner.graphs
    timed = make_prompts(batch, 16, llm.engine.model_config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    llm.generate(timed[:2], params)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(timed, params)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    n = graphs.stats.graphs if graphs is not None else 0
    del llm, graphs  # the next leg's engine gets the device memory back
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return MoEGraphLeg(cuda_graphs, n, [list(g) for g in got] == want, elapsed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.gpu.moe_graphs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32, help="requests of the timed run")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens of each timed request")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for name in ("layers", "experts", "hidden", "prompts", "new_tokens", "batch", "decode_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.hidden % 16:
        ap.error("--hidden must be a multiple of 16 (8 heads of an even size)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench.gpu.moe_graphs needs a CUDA device for --device {args.device} (or pass --device cpu)")
        return 2
    shape = MoEShape(
        layers=args.layers, experts=args.experts, hidden=args.hidden, expert_inter=args.hidden // 2
    )
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, _ = build_models(Path(tmp), shape)
        prompts = make_prompts(args.prompts, 12, shape.vocab, seed=5)
        want = hf_greedy(moe_dir, prompts, args.new_tokens, args.device)
        legs = [
            run_leg(moe_dir, args.device, g, prompts, want, args.batch, args.new_tokens, args.decode_tokens)
            for g in (True, False)
        ]
    result = MoEGraphResult(args.device, asdict(shape), args.prompts, args.new_tokens, args.batch, legs)
    print(result.markdown())
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return 0 if all(leg.tokens_equal_hf for leg in legs) else 1


if __name__ == "__main__":
    sys.exit(main())
