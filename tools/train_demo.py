"""Train loraplex's bundled demo: a tiny character-level Llama and four PEFT LoRA adapters.

The base model learns to echo: prompt ``f"{text}="``, completion ``f"{text}\\n"`` followed by ``</s>``,
where ``text`` is 1-3 words of 1-8 random lowercase letters joined by single spaces (at most 24
characters). Each adapter is a PEFT LoRA trained on top of the frozen base for the same prompt format,
completing with a transformed text instead::

    upper     text.upper()
    reverse   text[::-1]
    rot13     ROT13(text)
    novowels  text without the vowels a, e, i, o, u

Outputs (under ``--out``, default ``demo/``)::

    base/                    LlamaForCausalLM: config.json, generation_config.json, model.safetensors,
                             tokenizer.json + tokenizer_config.json (one token per character)
    adapters/<task>/         adapter_config.json + adapter_model.safetensors

Training is seeded (data, initialization and LoRA init all derive from ``--seed``) and runs on CPU only;
results are bit-identical for the same seed, thread count and torch build. The loss covers only the
completion tokens; prompts are encoded exactly as the engine encodes them (``tokenizer.encode(prompt)``,
which prepends ``<s>``).

Measured on the project's shared 2-core CPU machine (torch 2.13, ``--threads 2``, other jobs running):
the default run took 1191 s, about 20 minutes (base 595 s; adapters upper 123 s, reverse 223 s, rot13
116 s, novowels 120 s; the rest is evaluation), and reached 99.2-99.8% exact greedy completions on 500
held-out inputs per model. ``demo/README.md`` has the details and the engine's own measurement.

Usage::

    .venv/bin/python tools/train_demo.py                # full run, writes demo/
    .venv/bin/python tools/train_demo.py --only reverse # retrain one adapter on the existing base
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if __package__ in (None, ""):  # run as `python tools/train_demo.py`: make the `tools` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.demo_data import (
    ADAPTERS,
    DEMO_OUTPUTS,
    MAX_TEXT_CHARS,
    TASKS,
    ExampleStream,
    build_tokenizer,
    eval_texts,
    save_tokenizer,
)

__all__ = ["ADAPTERS", "DEMO_OUTPUTS", "TASKS", "DemoConfig", "main"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class DemoConfig:
    """Architecture and optimization settings of one training run (the defaults made the bundled demo)."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 64
    batch_size: int = 128
    base_steps: int = 1000
    base_lr: float = 3e-3
    # share of base inputs with uppercase letters too: trains the uppercase embeddings and output rows
    # the `upper` adapter must reach (a base that never saw them leaves LoRA unable to emit them)
    base_mixed_case: float = 0.25
    # share of base inputs drawn from 2-6 letters only (see ExampleStream and `lora_repetitive`)
    base_repetitive: float = 0.15
    lora_rank: int = 16
    lora_lr: float = 6e-3
    adapter_steps: dict[str, int] = field(
        default_factory=lambda: {"upper": 400, "reverse": 600, "rot13": 400, "novowels": 400}
    )
    # share of adapter inputs drawn from 2-6 letters only (see ExampleStream): without it `reverse`
    # stalls near 97.5% exact, skipping or looping over repeated substrings; with 0.3 it reaches >99%
    lora_repetitive: float = 0.3
    eval_samples: int = 500


def lr_factor(step: int, total: int, warmup: int = 100) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay from 1 to 0.1 at `total`."""
    warm = min(1.0, (step + 1) / max(1, min(warmup, total // 10)))
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, total) / total)))


def train(
    model: torch.nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    lr: float,
    weight_decay: float,
    progress: Progress,
    label: str,
) -> float:
    """AdamW on the trainable parameters for `steps` batches; returns the final smoothed loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    task = progress.add_task(label, total=steps, loss=float("nan"))
    smooth = float("nan")
    model.train()
    for _ in range(steps):
        ids, labels = next(batches)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        smooth = loss.item() if math.isnan(smooth) else 0.95 * smooth + 0.05 * loss.item()
        progress.update(task, advance=1, loss=smooth)
    model.eval()
    return smooth


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, task: str, texts: Sequence[str]) -> float:
    """Fraction of `texts` whose greedy completion, cut at the first '\\n', equals TASKS[task](text).

    Prompts of equal length are decoded together, so no padding (and no position shift) is involved.
    """
    stop_ids = [tokenizer.get_vocab()["\n"], tokenizer.eos_token_id]
    by_len: dict[int, list[str]] = {}
    for text in texts:
        by_len.setdefault(len(text), []).append(text)
    correct = 0
    for group in by_len.values():
        ids = torch.tensor([tokenizer.encode(f"{t}=") for t in group])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TEXT_CHARS + 2,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=tokenizer.pad_token_id,
        )
        for text, row in zip(group, out[:, ids.shape[1] :].tolist(), strict=True):
            answer = tokenizer.decode(row, skip_special_tokens=True).split("\n", 1)[0]
            correct += answer == TASKS[task](text)
    return correct / len(texts)


def new_base_model(cfg: DemoConfig, tokenizer: Any) -> Any:
    """A randomly initialized LlamaForCausalLM sized by `cfg` (untied embeddings, no sliding window)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def train_base(cfg: DemoConfig, base_dir: Path, progress: Progress) -> tuple[Any, float]:
    """Train the echo model and write it with its tokenizer to `base_dir`; returns (tokenizer, loss)."""
    tokenizer = build_tokenizer()
    model = new_base_model(cfg, tokenizer)
    rng = random.Random(f"{cfg.seed}-echo")
    batches = ExampleStream(tokenizer, "echo", cfg.batch_size, rng, cfg.base_mixed_case, cfg.base_repetitive)
    loss = train(model, batches, cfg.base_steps, cfg.base_lr, 0.1, progress, "base (echo)")
    if base_dir.exists():
        shutil.rmtree(base_dir)
    model.save_pretrained(str(base_dir))
    save_tokenizer(tokenizer, base_dir)
    return tokenizer, loss


def load_base(base_dir: Path) -> Any:
    """The saved base model in float32, in eval mode."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def train_adapter(
    cfg: DemoConfig, task: str, base_dir: Path, out_dir: Path, tokenizer: Any, progress: Progress
) -> tuple[Any, float]:
    """Train a PEFT LoRA for `task` on the frozen base and save it to `out_dir`; returns (model, loss)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed * 1000 + 1 + ADAPTERS.index(task))  # LoRA A is randomly initialized
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_rank,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_base(base_dir), lora)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    rng = random.Random(f"{cfg.seed}-{task}")
    batches = ExampleStream(tokenizer, task, cfg.batch_size, rng, repetitive=cfg.lora_repetitive)
    loss = train(model, batches, cfg.adapter_steps[task], cfg.lora_lr, 0.0, progress, f"lora {task}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(str(out_dir), save_embedding_layers=False)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
    # PEFT writes target_modules in set order, which varies with PYTHONHASHSEED; the engine's adapter
    # digest covers the config, so sort it to make reruns byte-identical
    cfg_path = out_dir / "adapter_config.json"
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["target_modules"] = sorted(adapter_cfg["target_modules"])
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True))
    return model, loss


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(
        prog="train_demo.py",
        description="Train loraplex's demo base model (echo) and its four LoRA adapters on CPU.",
    )
    p.add_argument("--out", type=Path, default=Path("demo"), help="output directory (default: demo)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed for data and initialization")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument(
        "--only",
        choices=("base", *ADAPTERS),
        action="append",
        help="train only these parts (repeatable); adapters reuse the base already in OUT/base",
    )
    p.add_argument("--base-steps", type=int, default=defaults.base_steps)
    p.add_argument(
        "--adapter-steps",
        type=int,
        default=None,
        help="steps for every adapter (default: per adapter, "
        + ", ".join(f"{k}={v}" for k, v in defaults.adapter_steps.items())
        + ")",
    )
    p.add_argument("--rank", type=int, default=defaults.lora_rank, help="LoRA rank")
    p.add_argument(
        "--eval-samples", type=int, default=defaults.eval_samples, help="held-out inputs per model"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Train the requested parts, save them under --out, and print held-out greedy accuracy per model."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = DemoConfig(seed=args.seed, base_steps=args.base_steps, lora_rank=args.rank)
    cfg.eval_samples = args.eval_samples
    if args.adapter_steps is not None:
        cfg.adapter_steps = dict.fromkeys(ADAPTERS, args.adapter_steps)
    parts = args.only or ["base", *ADAPTERS]
    base_dir = args.out / "base"
    if "base" not in parts and not (base_dir / "config.json").is_file():
        raise SystemExit(f"{base_dir} holds no trained base model; train it first (omit --only)")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never look anything up
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    console = Console()
    texts = eval_texts(cfg.seed, cfg.eval_samples)
    table = Table(title=f"demo models, greedy exact match on {len(texts)} held-out inputs")
    for col in ("model", "train steps", "final loss", "train time", "accuracy"):
        table.add_column(col)
    columns = (
        TextColumn("{task.description:<14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
    )
    started = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        if "base" in parts:
            t0 = time.perf_counter()
            _, loss = train_base(cfg, base_dir, progress)
            elapsed = time.perf_counter() - t0
            tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
            acc = greedy_accuracy(load_base(base_dir), tokenizer, "echo", texts)
            table.add_row("base (echo)", str(cfg.base_steps), f"{loss:.4f}", f"{elapsed:.0f} s", f"{acc:.1%}")
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        for task in ADAPTERS:
            if task not in parts:
                continue
            t0 = time.perf_counter()
            out_dir = args.out / "adapters" / task
            model, loss = train_adapter(cfg, task, base_dir, out_dir, tokenizer, progress)
            elapsed = time.perf_counter() - t0
            acc = greedy_accuracy(model, tokenizer, task, texts)
            steps = cfg.adapter_steps[task]
            table.add_row(f"lora {task}", str(steps), f"{loss:.4f}", f"{elapsed:.0f} s", f"{acc:.1%}")
    console.print(table)
    total = time.perf_counter() - started
    console.print(f"total {total:.0f} s with {args.threads} threads; wrote {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
