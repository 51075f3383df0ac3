"""The benchmark workload: a random-weight Llama (or a given checkpoint, HF or GGUF), random PEFT
adapters, token-id prompts, timed runs.

Everything is generated into a directory the caller owns (nothing is downloaded). `timed_run` drives
`LLMEngine` step by step and splits the wall time into prefill steps (any prompt token scheduled) and
decode steps (every scheduled item is one token), which is what the ratios in `docs/benchmarks.md` are
built from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJ_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of the random benchmark Llama (defaults: the shape issue 9 fixes)."""

    vocab_size: int = 8000
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    max_position_embeddings: int = 512

    def hf_config(self) -> dict[str, int]:
        """The shape as Hugging Face `LlamaConfig` fields."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
        }

    @classmethod
    def of_model(cls, model: Path) -> ModelSpec:
        """The shape of an existing checkpoint (HF directory or GGUF file), to build adapters for it."""
        from engine.model_config import ModelConfig

        c = ModelConfig.from_dir(model)
        if c.head_dim * c.num_heads != c.hidden_size:
            raise ValueError(f"{model}: head_dim x heads != hidden size; the benchmark adapters assume it")
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                   c.num_kv_heads, c.max_position_embeddings)  # fmt: skip

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each of the 7 projections."""
        h, i = self.hidden_size, self.intermediate_size
        kv = self.num_kv_heads * h // self.num_heads
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def build_base(root: Path, spec: ModelSpec = ModelSpec(), seed: int = 0) -> Path:
    """Save a random-weight `LlamaForCausalLM` of shape `spec` under `root/base` and return that path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**spec.hf_config())
    out = root / "base"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def hf_copy(model: Path, workdir: Path) -> Path:
    """An HF checkpoint directory with `model`'s weights: `model` itself when it is one; for a GGUF file,
    transformers' dequantized load of it saved under `workdir` (once), so peers that cannot read GGUF
    (vLLM's CPU build, HF + PEFT) run the identical weights."""
    from engine.model.gguf_file import find_gguf

    gguf = find_gguf(model)
    if gguf is None:
        return model
    out = workdir / f"hf-{gguf.stem}"
    if not (out / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw = {"gguf_file": gguf.name}
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # transformers marks GGUF loads as unsaveable
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(out)
    return out


def build_adapter(out: Path, spec: ModelSpec, rank: int, seed: int) -> Path:
    """Write a PEFT LoRA adapter with random A (~N(0, 1/in)) and B (~N(0, 1e-4)) on all 7 projections.

    `lora_alpha = 2 * rank`, so every adapter's scaling is 2.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for m, (fin, fout) in spec.projection_dims().items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJ_PARENT[m]}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJ_PARENT),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@dataclass(frozen=True, slots=True)
class LoRAOptions:
    """How the engine under test applies LoRA (`EngineConfig.lora_backend` / `lora_dtype`)."""

    backend: str = "auto"
    dtype: str = "auto"

    def engine_kwargs(self) -> dict[str, str]:
        return {"lora_backend": self.backend, "lora_dtype": self.dtype}

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--lora-backend", default="auto", help="auto, native, torch (CPU) or triton (CUDA)")
        ap.add_argument(
            "--lora-dtype", default="auto", help="adapter pool dtype: auto (= model), float16, bfloat16"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoRAOptions:
        return cls(args.lora_backend, args.lora_dtype)


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 1) -> list[list[int]]:
    """`num` prompts of `length` random token ids in [3, vocab_size)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=gen).tolist() for _ in range(num)]


@dataclass(slots=True)
class RunTiming:
    """Wall time of one batch run, split by step kind."""

    total_s: float
    prefill_s: float  # steps that scheduled any prompt token
    decode_s: float  # steps in which every scheduled item was a single decode token
    decode_steps: int
    prefill_steps: int
    output_tokens: int
    step_s: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)  # batch size of each decode step
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s


def timed_run(engine, prompts: Sequence[list[int]], params, loras: Sequence | None, tag: str) -> RunTiming:
    """Queue every prompt on `engine` (an `LLMEngine`), step until all finish, and time each step.

    `loras` is one `LoRARequest` (or None) per prompt, or None for the base model. The runner's
    `last_batch` (tokens, decodes) tells decode steps from steps with prompt tokens.
    """
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
        engine.add_request(rid, p, params, loras[i] if loras is not None else None)
    result = RunTiming(0.0, 0.0, 0.0, 0, 0, 0)
    final: dict[str, list[int]] = {}
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        tokens, decodes = engine.runner.last_batch
        result.step_s.append(dt)
        result.step_tokens.append(tokens)
        if tokens and tokens == decodes:
            result.decode_s += dt
            result.decode_steps += 1
            result.decode_batches.append(decodes)
        elif tokens:
            result.prefill_s += dt
            result.prefill_steps += 1
        for o in outs:
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
    result.total_s = time.perf_counter() - t_start
    result.token_ids = [final[r] for r in ids]
    result.output_tokens = sum(len(t) for t in result.token_ids)
    return result


def best(runs: Sequence[RunTiming]) -> RunTiming:
    """The fastest run (machines are noisy; best-of-N estimates the uncontended time)."""
    return min(runs, key=lambda r: r.total_s)


@contextlib.contextmanager
def bench_env(threads: int, workdir: Path | None) -> Iterator[Path]:
    """Run with `threads` torch intra-op threads (0: leave as is; restored after) in `workdir`, or in a
    temporary directory removed afterwards when `workdir` is None."""
    prev = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        if workdir is not None:
            yield Path(workdir)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                yield Path(tmp)
    finally:
        torch.set_num_threads(prev)


def report(result, json_path: Path | None, plot_path: Path | None, plot) -> object:
    """Print the result's markdown table, write its JSON and its plot when paths are given; return it."""
    print(result.markdown())
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_dict(), indent=2))
    if plot_path is not None:
        plot(result, plot_path)
    return result
