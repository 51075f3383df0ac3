"""HF transformers + PEFT baseline: one mixed-adapter batch through `generate(adapter_names=...)`."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def load_peft_model(base: Path, adapter_dirs: list[Path]):
    """The base model in float32 with every adapter loaded under the name `a{i}`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dirs[0], adapter_name="a0")
    for i, d in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(d, adapter_name=f"a{i}")
    return model.eval()


@torch.inference_mode()
def time_peft_generate(
    model, prompts: list[list[int]], adapter_index: list[int], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """Greedy `generate` of all prompts (equal lengths) in one batch, request i on adapter `a{index[i]}`.

    Returns (wall seconds, generated token ids per prompt).
    """
    ids = torch.tensor(prompts, dtype=torch.int64)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        adapter_names=[f"a{i}" for i in adapter_index],
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    dt = time.perf_counter() - t0
    return dt, out[:, ids.shape[1] :].tolist()
