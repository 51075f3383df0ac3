"""Tiny GGUF files for tests, written with `gguf.GGUFWriter` from a tiny random HF checkpoint the way
llama.cpp's converter writes them (GGUF tensor names, q/k rows permuted for llama and granite, norms in
F32; granite's multipliers, phi3's fused tensors, rotary dims and LongRoPE factors in the metadata).

Types `gguf` can quantize (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) hold the checkpoint's weights,
quantized; for K-quants (which `gguf` only dequantizes) every matmul weight is random but valid blocks.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # phi3's fused tensors
    "mlp.gate_up_proj": "ffn_up",
}
_GEMMA_TO_GGUF = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# mixture-of-experts families: router, q/k norms, Qwen2-MoE's shared expert (the experts: `_stack_experts`)
_MOE_TO_GGUF = {
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_MOE_ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up"}
_EXPERT_PROJ["w2"] = "down"  # (Mixtral's older names)
# byte offsets of the float16 scale fields in one block of each K-quant (the rest may be any bytes)
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def char_vocab(size: int) -> list[str]:
    """SentencePiece-style character vocabulary of `size` tokens: <unk>, <s>, </s>, ▁ (space), …"""
    chars = ["▁", *string.ascii_letters, *string.digits, *string.punctuation]
    tokens = ["<unk>", "<s>", "</s>", *chars]
    assert len(tokens) >= size, size
    return tokens[:size]


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter order for q/k rows (the inverse of the loader's `unpermute_rows`)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf_key: str, overrides: dict[str, str] | None = None) -> str | None:
    """The GGUF tensor name of an HF key (`overrides`: a family's per-layer module names)."""
    names = _HF_TO_GGUF | (overrides or {})
    if hf_key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_key == "model.norm.weight":
        return "output_norm.weight"
    if hf_key == "lm_head.weight":
        return "output.weight"
    parts = hf_key.split(".")
    layer, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{names[module]}.{leaf}" if module in names else None


def _encode(name: str, w: np.ndarray, qtype: str, rng: np.random.Generator):
    """(array, raw ggml type or None) of one tensor stored as `qtype`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quantize

    kind = GGMLQuantizationType[qtype]
    block, type_size = GGML_QUANT_SIZES[kind]
    if w.ndim == 1 or qtype == "F32" or w.shape[-1] % block:
        return w.astype(np.float32), None  # llama.cpp keeps norms (and rows it cannot block) in F32
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype in _K_SCALE_OFFSETS:
        blocks = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, type_size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.02 if qtype != "Q6_K" else 0.004).tobytes(), np.uint8)
        for off in _K_SCALE_OFFSETS[qtype]:
            blocks[..., off : off + 2] = scale
        return blocks.reshape(w.shape[0], -1), kind
    return quantize(w.astype(np.float32), kind), kind


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: str = "F32",
    tokenizer: bool = True,
    rope_freqs: list[float] | None = None,
    name: str = "tiny-test-model",
    skip: tuple[str, ...] = (),
    seed: int = 0,
    tokenizer_model: str = "llama",
    stacked_experts: bool = True,
) -> Path:
    """Write the checkpoint in `hf_dir` (a tiny llama, qwen2, granite, phi3, gemma2, gemma3, or the MoE
    qwen3_moe, qwen2_moe, mixtral, olmoe) as the GGUF file `out`; a MoE's experts stacked in 3-D tensors
    (`stacked_experts=False`: one tensor per expert, as older Mixtral files hold them)."""
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    archs = {"llama": "llama", "qwen2": "qwen2", "granite": "granite", "phi3": "phi3", "gemma2": "gemma2"}
    arch = (archs | {"gemma3_text": "gemma3"} | _MOE_ARCHS)[cfg["model_type"]]
    moe = cfg["model_type"] in _MOE_ARCHS
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    _family_metadata(w, arch, cfg)
    if moe:
        _moe_metadata(w, cfg, head_dim)
    if arch == "gemma3":  # the global layers' base
        w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    else:
        w.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        tokens = char_vocab(cfg["vocab_size"])
        w.add_tokenizer_model(tokenizer_model)
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    state = load_file(str(hf_dir / "model.safetensors"))
    if moe:
        state = _stack_experts(state, stacked_experts)
    for key, t in state.items():
        overrides = _GEMMA_TO_GGUF if arch.startswith("gemma") else (_MOE_TO_GGUF if moe else {})
        gname = key if key.startswith("blk.") else gguf_name(key, overrides)
        if gname is None or gname in skip:
            continue
        t = t.float()
        if arch.startswith("gemma") and key.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp's converter stores Gemma's (1 + w)
        if arch in ("llama", "granite") and gname.endswith(("attn_q.weight", "attn_k.weight")):
            t = permute_rows(t, heads if "attn_q" in gname else kv_heads)
        data, raw = _encode(gname, t.numpy(), qtype, rng)
        w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _stack_experts(state: dict[str, torch.Tensor], stacked: bool) -> dict[str, torch.Tensor]:
    """`state` with the expert weights (per-expert or fused keys) as llama.cpp's converter writes them:
    `blk.N.ffn_{gate,up,down}_exps.weight` [E, I, H] / [E, H, I], or per expert `blk.N.ffn_gate.E.weight`."""
    out, pieces = {}, {}
    for key, t in state.items():
        m, f = _EXPERT_KEY.match(key), _FUSED_KEY.match(key)
        if m is not None:
            pieces[(int(m[1]), _EXPERT_PROJ[m[3]], int(m[2]))] = t
        elif f is not None and f[2] == "down_proj":
            pieces |= {(int(f[1]), "down", e): t[e] for e in range(t.shape[0])}
        elif f is not None:
            half = t.shape[1] // 2
            pieces |= {(int(f[1]), "gate", e): t[e, :half] for e in range(t.shape[0])}
            pieces |= {(int(f[1]), "up", e): t[e, half:] for e in range(t.shape[0])}
        else:
            out[key] = t
    for layer, proj in sorted({(k[0], k[1]) for k in pieces}):
        experts = sorted(e for (lyr, p, e) in pieces if (lyr, p) == (layer, proj))
        if stacked:
            stack = torch.stack([pieces[(layer, proj, e)] for e in experts])
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = stack
        else:
            out |= {f"blk.{layer}.ffn_{proj}.{e}.weight": pieces[(layer, proj, e)] for e in experts}
    return out


def _moe_metadata(w, cfg: dict, head_dim: int) -> None:
    """The `{arch}.expert_*` fields llama.cpp's converter writes, and the head size when it is not
    hidden / heads (Qwen3-MoE)."""
    w.add_expert_count(int(cfg.get("num_experts") or cfg["num_local_experts"]))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    if cfg.get("clip_qkv") is not None:
        w.add_clamp_kqv(float(cfg["clip_qkv"]))
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _family_metadata(w, arch: str, cfg: dict) -> None:
    """Granite's multipliers; phi3's sliding window (0: none), LongRoPE factors and attention factor."""
    import math

    if arch == "granite":
        w.add_embedding_scale(float(cfg["embedding_multiplier"]))
        w.add_attention_scale(float(cfg["attention_multiplier"]))
        w.add_residual_scale(float(cfg["residual_multiplier"]))
        w.add_logit_scale(float(cfg["logits_scaling"]))
    if arch.startswith("gemma"):
        import gguf

        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
        w.add_sliding_window(int(cfg["sliding_window"]))
        if cfg.get("attn_logit_softcapping") and arch == "gemma2":
            w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        full = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))
    if arch != "phi3":
        return
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        orig = int(cfg["original_max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> list[float]:
    """The `rope_freqs` llama.cpp's converter writes for llama3 RoPE scaling: plain / scaled inv_freq."""
    from engine.model.rope import rope_inv_freq

    plain = rope_inv_freq(head_dim, theta, None)
    scaled = rope_inv_freq(head_dim, theta, scaling)
    return (plain / scaled).tolist()


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def build_gguf_pair(root: Path, arch: str, qtype: str, **write_kwargs) -> tuple[Path, Path]:
    """(HF dir, GGUF file) of a tiny random `arch` model (without RoPE scaling), as `qtype`; K-quants get
    rows of 256 (their block) by a hidden size of 256."""
    from tests.helpers.tiny_models import build_checkpoint

    shape = dict(hidden_size=256, intermediate_size=512) if qtype in K_QUANTS else {}
    scaling = {"rope_scaling": None} if arch == "llama" else {}
    hf = build_checkpoint(root / "hf", arch, **shape, **scaling)
    return hf, write_gguf(hf, root / "gguf" / f"tiny-{qtype}.gguf", qtype, **write_kwargs)


def hf_gguf_model(gguf: Path, dtype: torch.dtype = torch.float32):
    """The oracle: transformers' own load of the GGUF file (dequantized)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
