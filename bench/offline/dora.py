"""Issue 31's engine-level DoRA benchmark: one batch of 32 greedy requests over 32 DoRA adapters vs the
same batch over 32 plain LoRA adapters of the same rank (goal: DoRA costs at most 1.1x plain LoRA).

    python -m bench.offline.dora [--adapters 32] [--rank 16] [--prompt-len 32] [--new-tokens 16]
                                 [--repeats 3] [--threads 0] [--wide]

On the benchmark Llama (`bench.common.workload.ModelSpec`, random weights; `--wide` adds a hidden-1536,
intermediate-4096, 2-layer shape): rank-`--rank` adapters on all 7 projections. The DoRA adapters are
the plain ones plus `use_dora: true` and a `lora_magnitude_vector` per module, PEFT's initial magnitude
(the row norms of `W + s * B @ A`) scaled by a random factor near 1, so the DoRA rows really rescale.
Every run is one batch of `--adapters` greedy requests, one per adapter; the two kinds run in one engine
each (float32, CPU), timed interleaved after a warm-up round, best of `--repeats` (total and decode phase each
their own best run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bench.common.workload import ModelSpec, bench_env, best, build_adapter, build_base, make_prompts
from bench.offline.interleaved import interleaved_runs
from engine import LLM, LoRARequest, SamplingParams

WIDE = ModelSpec(hidden_size=1536, intermediate_size=4096, num_layers=2, num_heads=12, num_kv_heads=4)


def dora_adapter(plain: Path, out: Path, base: Path, seed: int) -> Path:
    """`plain`'s LoRA as a DoRA adapter: `use_dora` plus a magnitude vector per module (PEFT's initial
    row norms of the adapted weight, times a random factor in [0.9, 1.1])."""
    tensors = load_file(plain / "adapter_model.safetensors")
    config = json.loads((plain / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    gen = torch.Generator().manual_seed(seed)
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            prefix = key.removesuffix(".lora_A.weight")
            a, b = tensors[key], tensors[f"{prefix}.lora_B.weight"]
            w = f.get_tensor(prefix.removeprefix("base_model.model.") + ".weight")
            norm = (w + scaling * (b @ a)).norm(dim=1)
            factor = 0.9 + 0.2 * torch.rand(norm.shape, generator=gen)
            tensors[f"{prefix}.lora_magnitude_vector"] = norm * factor
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    return out


def run(adapters: int = 32, rank: int = 16, prompt_len: int = 32, new_tokens: int = 16, repeats: int = 3,
        spec: ModelSpec | None = None, workdir: Path | None = None,
        threads: int = 0) -> list[str]:  # fmt: skip
    """One line per kind at shape `spec`: best total and best decode-phase time, and the ratios to plain."""
    spec = spec or ModelSpec()
    with bench_env(threads, workdir) as root:
        base = build_base(root, spec)
        plain = [build_adapter(root / f"plain{i}", spec, rank, seed=i) for i in range(adapters)]
        dora = [dora_adapter(plain[i], root / f"dora{i}", base, seed=i) for i in range(adapters)]
        kinds = {
            "plain LoRA": [LoRARequest(f"p{i}", str(plain[i])) for i in range(adapters)],
            "DoRA": [LoRARequest(f"d{i}", str(dora[i])) for i in range(adapters)],
        }
        prompts = make_prompts(adapters, prompt_len, spec.vocab_size)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engines = {
            k: LLM(str(base), device="cpu", dtype="float32", max_loras=adapters, max_lora_rank=rank).engine
            for k in kinds
        }
        runs = interleaved_runs(engines, kinds, prompts, params, repeats)
        shape = f"hidden {spec.hidden_size}, inter {spec.intermediate_size}, {spec.num_layers} layers"
        ref, lines = best(runs["plain LoRA"]), []
        ref_decode = min(x.decode_s for x in runs["plain LoRA"])
        for kind in kinds:
            t, decode = best(runs[kind]), min(x.decode_s for x in runs[kind])  # each phase's best run
            lines.append(
                f"{kind} ({shape}): total {t.total_s * 1e3:.0f} ms ({t.total_s / ref.total_s:.3f}x), "
                f"decode {decode * 1e3:.0f} ms ({decode / ref_decode:.3f}x), "
                f"{t.decode_steps} decode steps, {adapters} adapters rank {rank}"
            )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--wide", action="store_true", help="also run the hidden-1536, 2-layer shape")
    args = ap.parse_args(argv)
    lines = []
    for spec in [ModelSpec()] + ([WIDE] if args.wide else []):
        lines += run(args.adapters, args.rank, args.prompt_len, args.new_tokens, args.repeats, spec,
                     threads=args.threads)  # fmt: skip
        print("\n".join(lines[-2:]), flush=True)
    return lines


if __name__ == "__main__":
    main()
