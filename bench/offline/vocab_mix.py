"""Issue 31's batch benchmarks: 4 adapters with `modules_to_save` LM heads vs 4 plain LoRA adapters, and
4 weighted mixes of two plain adapters each vs the same 4 plain adapters alone (cost and memory).

    python -m bench.offline.vocab_mix [--requests 16] [--prompt-len 32] [--new-tokens 16] [--repeats 3]

On the benchmark Llama (`bench.common.workload.ModelSpec`, random weights, vocab 8000): rank-16 adapters
on all 7 projections; the "saved head" adapters carry in addition a whole trained `lm_head` copy
(`modules_to_save`), so each of their rows computes its logits with its own head; they run with a side
budget that holds all 4 copies, and once with the default budget (the pages' bytes), which may hold
fewer, so their requests take turns. Every run is one batch
of `--requests` greedy requests, the adapters (or mixes) in turn; the three kinds are timed interleaved,
best of `--repeats`, in one engine each. Memory: the device bytes the resident adapters take, pages and
side stores (`engine/lora/side_memory.py`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.common.workload import ModelSpec, bench_env, best, build_adapter, build_base, make_prompts
from bench.offline.interleaved import interleaved_runs
from engine import LLM, LoRARequest, SamplingParams


def saved_head_adapter(plain: Path, out: Path, base: Path, seed: int) -> Path:
    """`plain`'s LoRA plus a perturbed copy of the base `lm_head` saved whole (`modules_to_save`)."""
    from safetensors import safe_open

    tensors = load_file(plain / "adapter_model.safetensors")
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        key = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
        head = f.get_tensor(key)
    gen = torch.Generator().manual_seed(seed)
    tensors["base_model.model.lm_head.weight"] = head + torch.randn(head.shape, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = json.loads((plain / "adapter_config.json").read_text()) | {"modules_to_save": ["lm_head"]}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(requests: int = 16, prompt_len: int = 32, new_tokens: int = 16, repeats: int = 3,
        spec: ModelSpec | None = None, workdir: Path | None = None) -> list[str]:  # fmt: skip
    """One line per kind: total and decode time, ratio to plain LoRA, and the adapters' device memory."""
    spec = spec or ModelSpec()
    with bench_env(0, workdir) as root:
        base = build_base(root, spec)
        plain = [build_adapter(root / f"plain{i}", spec, 16, seed=i) for i in range(8)]
        saved = [saved_head_adapter(plain[i], root / f"saved{i}", base, seed=i) for i in range(4)]
        kinds = {
            "plain LoRA": [LoRARequest(f"p{i}", str(plain[i])) for i in range(4)],
            "saved LM head": [LoRARequest(f"s{i}", str(saved[i])) for i in range(4)],
            "saved LM head, default side budget": [LoRARequest(f"s{i}", str(saved[i])) for i in range(4)],
            "mix of 2": [
                LoRARequest.weighted(
                    [
                        (LoRARequest(f"p{i}", str(plain[i])), 0.6),
                        (LoRARequest(f"q{i}", str(plain[4 + i])), 0.4),
                    ]
                )
                for i in range(4)
            ],
        }
        prompts = make_prompts(requests, prompt_len, spec.vocab_size)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        heads = 4 * spec.vocab_size * spec.hidden_size * 4  # room for the 4 saved heads (float32)
        engines = {
            k: LLM(
                str(base),
                device="cpu",
                dtype="float32",
                max_loras=8,
                max_lora_rank=16,
                lora_side_memory_bytes=None if "default" in k else heads + 2**20,
            ).engine
            for k in kinds
        }
        per_request = {k: [loras[i % 4] for i in range(requests)] for k, loras in kinds.items()}
        runs = interleaved_runs(engines, per_request, prompts, params, repeats)
        ref = best(runs["plain LoRA"])
        lines = []
        for kind in kinds:
            t = best(runs[kind])
            pool = engines[kind].lora.pool
            page_bytes = sum(
                len(res.pages[m]) * (pool.a[m][0].numel() + pool.b[m][0].numel()) * pool.a[m].element_size()
                for res in pool.resident.values()
                for m in range(len(pool.a))
            )
            lines.append(
                f"{kind}: total {t.total_s * 1e3:.0f} ms ({t.total_s / ref.total_s:.2f}x), decode "
                f"{t.decode_s * 1e3:.0f} ms ({t.decode_s / ref.decode_s:.2f}x); "
                f"{len(pool.resident)} resident, "
                f"pages {page_bytes / 2**20:.1f} MiB, side stores {pool.side_used / 2**20:.1f} MiB"
            )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = run(args.requests, args.prompt_len, args.new_tokens, args.repeats)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
