"""Compatibility shim: the first offline benchmark now lives in `bench.offline` (benchmark 1).

`build_base(root)` and `build_adapter(base, out, rank, seed)` keep their old signatures for callers such
as `bench/online.py`; `python bench/offline_lora.py ...` runs `bench.offline.main`.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import workload
from bench.workload import ModelSpec


def build_base(root: Path, seed: int = 0) -> Path:
    """Save the benchmark Llama (issue 9's shape) under `root/base`."""
    return workload.build_base(root, ModelSpec(), seed)


def build_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    """A random rank-`rank` PEFT adapter on all 7 projections of the model saved at `base`."""
    cfg = json.loads((Path(base) / "config.json").read_text())
    spec = ModelSpec(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
    )
    return workload.build_adapter(out, spec, rank, seed)


if __name__ == "__main__":
    from bench.offline import main

    main()
