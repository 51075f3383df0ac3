"""Typed views of a Hugging Face checkpoint's `config.json` and the dtype choices made from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.cpu_features import native_bfloat16
from engine.model.registry import SUPPORTED_ARCHITECTURES, model_family

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "ModelConfigError"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelConfigError(ValueError):
    """The checkpoint directory is missing, malformed or of an unsupported architecture."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a checkpoint's `config.json`.

    Accepts both the transformers 4.x spelling (`rope_theta`, `rope_scaling`, `torch_dtype`) and the 5.x
    spelling (`rope_parameters`, `dtype`).
    """

    path: Path
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    extra: dict[str, Any] = field(default_factory=dict)
    o_bias: bool = False  # a bias on o_proj (Llama's and Qwen3's `attention_bias`; not Qwen2's)
    mlp_bias: bool = False  # biases on gate/up/down (Llama's `mlp_bias`)
    context_cap: int | None = None  # `EngineConfig.max_model_len` (vLLM's --max-model-len); see `capped`

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the engine will accept for this model: its positions, or
        fewer when capped (`capped`). A sliding window does not cap it (the attention paths mask each
        windowed layer's rows to their window, `engine.attention.backend`)."""
        if self.context_cap is None:
            return self.max_position_embeddings
        return min(self.context_cap, self.max_position_embeddings)

    def capped(self, max_model_len: int | None) -> ModelConfig:
        """This config with its context capped at `max_model_len` tokens (None: uncapped); ValueError
        when that is below 2 or beyond the model's positions (as vLLM refuses it)."""
        if max_model_len is None:
            return self
        if not 2 <= max_model_len <= self.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in [2, {self.max_position_embeddings}] (this model's positions), "
                f"got {max_model_len}"
            )
        return replace(self, context_cap=max_model_len)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` and return the engine's view of it, or raise `ModelConfigError`.

        `path` may also be a llama.cpp GGUF file (or a directory holding one and no `config.json`): its
        metadata then stands in for `config.json` (`engine.model.gguf_file`)."""
        root = Path(path)
        from engine.model.gguf_file import find_gguf, gguf_model_config  # imports this module

        gguf = find_gguf(root)
        if gguf is not None:
            return gguf_model_config(gguf)
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(f"{root}: no config.json (expected a Hugging Face checkpoint directory)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{cfg_file}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, root)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path | None = None) -> ModelConfig:
        """The generic parse of `config.json`'s fields, then the family's adjustments (`configure` of
        `engine/model/family.py`); `ModelConfigError` for what the engine cannot run."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = model_family(arch)
        raw = family.normalize(arch, raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            vocab = int(raw["vocab_size"])
            inter = int(raw["intermediate_size"])
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks required field {exc.args[0]!r}") from exc
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of kv heads={kv_heads}")
        head_dim = int(raw.get("head_dim") or hidden // heads)

        rope = dict(raw.get("rope_parameters") or {})
        legacy_scaling = raw.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling: dict[str, Any] | None = None
        if rope_type not in (None, "default"):
            if rope_type not in family.rope_types:
                raise ModelConfigError(
                    f"rope scaling {rope_type!r} is not supported for {arch} "
                    f"(supported: {', '.join(family.rope_types)})"
                )
            rope_scaling = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": rope_type}

        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ModelConfigError(f"checkpoint dtype {dtype_name!r} is not supported")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        fields: dict[str, Any] = dict(
            path=path or Path("."),
            architecture=arch,
            model_type=str(raw.get("model_type", "")),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", False)),
            qk_norm=False,
            checkpoint_dtype=_DTYPES[dtype_name],
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding) if sliding else None,
            extra={"hidden_act": raw.get("hidden_act", "silu")},
        )
        overrides = family.configure(arch, raw)
        extra = fields["extra"] | overrides.pop("extra", {})
        return cls(**(fields | overrides | {"extra": extra}))


def check_dtype_name(what: str, value: str | torch.dtype) -> None:
    """ValueError unless `value` is a supported torch dtype, "auto" or one of its names; `what` names the
    setting in the message ("dtype", "lora_dtype")."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"{what} {value} is not supported; use float32, bfloat16 or float16")
    elif value != "auto" and value not in _DTYPES:
        raise ValueError(f"{what} {value!r} is not supported; use auto, float32, bfloat16 or float16")


def resolve_dtype(dtype: str | torch.dtype, model: ModelConfig, device: torch.device) -> torch.dtype:
    """Map the user's `dtype` choice to a torch dtype; `"auto"` takes the checkpoint's.

    On CPU, a half-precision checkpoint's "auto" is bfloat16 where the CPU multiplies bfloat16 natively
    (AVX-512 BF16, AMX, Arm BF16) and float32 elsewhere (emulated half matmuls are slower than float32,
    and float16 ones lossy); a float32 checkpoint stays float32. An explicit choice is honoured.
    `dtype_reason` says which rule applied.
    """
    check_dtype_name("dtype", dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        chosen = model.checkpoint_dtype
        if device.type == "cpu" and chosen in (torch.float16, torch.bfloat16):
            return torch.bfloat16 if native_bfloat16() else torch.float32
        return chosen
    return _DTYPES[dtype]


def dtype_reason(dtype: str | torch.dtype, model: ModelConfig, device: torch.device) -> str:
    """Why `resolve_dtype` chose what it did, for the startup log (a GGUF checkpoint's tensor types too)."""
    reason = _dtype_rule(dtype, model, device)
    gguf_types = model.extra.get("gguf_types")
    return f"{reason}; GGUF file, {gguf_types} dequantized at load" if gguf_types else reason


def _dtype_rule(dtype: str | torch.dtype, model: ModelConfig, device: torch.device) -> str:
    if dtype != "auto":
        return "as configured"
    ckpt = str(model.checkpoint_dtype).removeprefix("torch.")
    if device.type != "cpu" or model.checkpoint_dtype == torch.float32:
        return f"auto: the checkpoint's {ckpt}"
    flag = native_bfloat16()
    if flag:
        return f"auto: {ckpt} checkpoint, and this CPU computes bfloat16 natively ({flag})"
    return f"auto: {ckpt} checkpoint, but this CPU has no native bfloat16 (no AVX-512 BF16/AMX): float32"


def resolve_lora_dtype(lora_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The adapter pool's dtype: `"auto"` is the model's; adapters may be kept narrower (e.g. float16
    pages under a float32 model, half the memory traffic per decode step) and are widened when applied."""
    check_dtype_name("lora_dtype", lora_dtype)
    if isinstance(lora_dtype, torch.dtype):
        return lora_dtype
    return model_dtype if lora_dtype == "auto" else _DTYPES[lora_dtype]
