"""Tiny PEFT LoRA adapters for a tiny base checkpoint, and PEFT itself as the numerics oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Adapters with different ranks, targets and options; every rank fits max_lora_rank=32.
ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "all7-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "qv-r8-rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "pattern-r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
        rank_pattern={"o_proj": 4, "k_proj": 2},
        alpha_pattern={"down_proj": 64},
    ),
    "layer1-r32": dict(r=32, lora_alpha=16, target_modules=["v_proj", "up_proj"], layers_to_transform=[1]),
    "mlp-regex-r1": dict(r=1, lora_alpha=4, target_modules=r".*\.mlp\.(gate|up)_proj"),
    "gud-r12": dict(r=12, lora_alpha=24, target_modules=["gate_proj", "up_proj", "down_proj"]),
}

# Phi-3's PEFT targets are its fused modules (qkv_proj, gate_up_proj) besides o_proj and down_proj.
PHI3_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "all-r4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "qkv-r8-rslora": dict(r=8, lora_alpha=16, target_modules=["qkv_proj"], use_rslora=True),
    "fused-pattern-r16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        rank_pattern={"o_proj": 4, "gate_up_proj": 2},
        alpha_pattern={"down_proj": 64},
    ),
    "gate-up-layer1-r32": dict(r=32, lora_alpha=16, target_modules=["gate_up_proj"], layers_to_transform=[1]),
}

# LoRA on the vocabulary modules (PEFT's `Embedding` LoRA on embed_tokens, a Linear LoRA on lm_head), with
# and without projection targets; on Qwen2 the two stay independent though the weights are tied.
VOCAB_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "embed-q-r4": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    "head-v-r8": dict(r=8, lora_alpha=8, target_modules=["lm_head", "v_proj", "down_proj"]),
    "both-only-rslora": dict(
        r=8,
        lora_alpha=8,
        target_modules=["embed_tokens", "lm_head"],
        use_rslora=True,
        rank_pattern={"lm_head": 2},
        alpha_pattern={"embed_tokens": 4},
    ),
}

# Trainable tokens (PEFT's TrainableTokens through LoraConfig.trainable_token_indices): new embedding rows
# (and, tied, head rows) for some ids; the dict form also names lm_head rows of its own.
TOKEN_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "tokens-list": dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 9, 17, 33, 60]
    ),
    "tokens-dict": dict(
        r=2,
        lora_alpha=4,
        target_modules=["o_proj"],
        trainable_token_indices={"embed_tokens": [7, 12, 40], "lm_head": [12, 50, 3, 71]},
    ),
}

# modules_to_save (PEFT's ModulesToSaveWrapper): whole trained copies of embed_tokens and/or lm_head; on
# Qwen2 (tied) each copy replaces only its own module, as in PEFT.
SAVED_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "saved-both": dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]
    ),
    "saved-embed": dict(r=2, lora_alpha=4, target_modules=["o_proj"], modules_to_save=["embed_tokens"]),
    "saved-head": dict(r=4, lora_alpha=4, target_modules=["down_proj"], modules_to_save=["lm_head"]),
}


def build_adapter(base_dir: Path, out_dir: Path, seed: int = 0, scale: float = 0.3, **lora_kwargs) -> Path:
    """Wrap the base model with a PEFT LoRA config, give A and B (and trainable tokens' rows) random
    weights, perturb modules_to_save copies randomly, save it to `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "trainable_tokens_delta" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(out_dir)
    return out_dir


class PeftGreedyOracle:
    """Greedy decoding by HF transformers + PEFT, one request at a time (adapter None = base model)."""

    def __init__(self, base_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.base_dir, self.dtype = base_dir, dtype
        self._models: dict[Path | None, Any] = {}

    def _model(self, adapter_dir: Path | None):
        if adapter_dir not in self._models:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=self.dtype)
            model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
            model = model.to(self.dtype)  # PEFT keeps the adapter weights in float32 otherwise
            self._models[adapter_dir] = model.eval()
        return self._models[adapter_dir]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, adapter_dir: Path | None) -> list[int]:
        model = self._model(adapter_dir)
        ids = list(prompt)
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    @torch.no_grad()
    def logits(self, tokens: list[int], adapter_dir: Path | None) -> torch.Tensor:
        """float32 next-token logits after each prefix of `tokens` (teacher-forced): row i follows
        tokens[: i + 1]."""
        return self._model(adapter_dir)(input_ids=torch.tensor([tokens])).logits[0].float()


def bf16_gaps_vs_noise(oracles, prompt: list[int], ours: list[int], adapter) -> torch.Tensor:
    """Per generated token: how far below PEFT-bfloat16's max logit the engine's token is, in units of
    PEFT's own bfloat16 noise at that step (its largest logit difference from PEFT in float32).
    `oracles`: (the bfloat16 PeftGreedyOracle, the float32 one)."""
    bf16, fp32 = (o.logits(prompt + ours, adapter)[len(prompt) - 1 : -1] for o in oracles)
    gap = bf16.max(dim=1).values - bf16[torch.arange(len(ours)), torch.tensor(ours)]
    noise = (bf16 - fp32).abs().max(dim=1).values
    return gap / (noise + 1e-3)
