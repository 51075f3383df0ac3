"""Offline mixed-adapter throughput: loraplex with N distinct adapters vs the same batch on the base model.

    python bench/offline_lora.py [--adapters 32] [--requests 32] [--prompt-len 64] [--new-tokens 48]

Builds a random-weight Llama (hidden 384, 6 layers, intermediate 1024, vocab 8000, 6 heads / 2 KV heads)
and N random rank-r PEFT adapters on all 7 projections in a temporary directory (nothing downloaded),
then times, in one process and one after another, greedy generation of the same batch with each
request on its own adapter and with no adapters. Prints a markdown table; ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJ = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def build_base(root: Path, seed: int = 0) -> Path:
    """Save the random benchmark Llama under `root/base`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=8000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    out = root / "base"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def build_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    """Write a PEFT-format LoRA adapter with random A and B on every projection of every layer."""
    cfg = json.loads((base / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    dims = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m, (fin, fout) in dims.items():
            prefix = f"base_model.model.model.layers.{i}.{PROJ[m]}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(dims),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def time_generate(llm, prompts, params, loras) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from engine import LLM, LoRARequest, SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_base(root)
        loras = [
            LoRARequest(f"a{i}", str(build_adapter(base, root / f"a{i}", args.rank, i)))
            for i in range(args.adapters)
        ]
        gen = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(3, 8000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)
        ]
        per_req = [loras[i % len(loras)] for i in range(args.requests)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        llm = LLM(
            str(base),
            device="cpu",
            dtype="float32",
            max_loras=args.adapters,
            max_lora_rank=max(16, args.rank),
            enable_prefix_caching=False,
        )
        time_generate(llm, prompts[:4], params, per_req[:4])  # warm-up
        for lr in set(per_req):
            llm.engine.pin_lora(llm.engine.add_lora(lr))
        mixed, base_only = [], []
        for _ in range(args.repeats):  # interleaved, best of N: machines are noisy
            mixed.append(time_generate(llm, prompts, params, per_req))
            base_only.append(time_generate(llm, prompts, params, None))
        tokens = args.requests * args.new_tokens
        tm, tb = min(mixed), min(base_only)
        label = f"loraplex, {args.adapters} adapters (rank {args.rank}, all 7 projections)"
        print("| run | time (s) | output tok/s |\n|---|---|---|")
        print(f"| {label} | {tm:.2f} | {tokens / tm:.0f} |")
        print(f"| loraplex, base model only | {tb:.2f} | {tokens / tb:.0f} |")
        print(f"\nLoRA overhead (mixed / base time): **{tm / tb:.2f}x**")


if __name__ == "__main__":
    main()
