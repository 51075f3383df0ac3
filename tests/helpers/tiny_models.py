"""Tiny random Hugging Face checkpoints for tests (built locally, nothing downloaded)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
GEMMA_ARCHS = ("gemma2", "gemma3")
# Families on the model seam beyond Llama's (tests/engine/test_granite_phi3.py)
MORE_ARCHS = ("granite", "phi3", "phi3-longrope")
# Mixture-of-experts families (tests/engine/test_moe_models.py); "-fused": transformers 5's fused 3-D
# expert tensors in the safetensors file instead of the per-expert layout save_pretrained writes
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")
LONGROPE_ORIGINAL = 32  # phi3-longrope's original_max_position_embeddings (of 256)

_BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def build_checkpoint(out_dir: Path, arch: str, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a random `arch` model to `out_dir` (safetensors + config.json) and return the directory.

    Variations by family: llama uses llama3 RoPE scaling; qwen2 has q/k/v bias and tied embeddings;
    qwen3 has q/k norms and a head_dim different from hidden/heads; mistral has a sliding window
    larger than the context (unless overridden); gemma2 and gemma3 have windows of 8 tokens,
    soft-caps, and gemma3 layers 2:1 local/global with linearly scaled global RoPE; granite has all
    four multipliers away from 1; phi3 has fused qkv/gate_up
    weights and partial rotary (half of each head); phi3-longrope has LongRoPE with short/long factors
    (original length `LONGROPE_ORIGINAL`) on full heads; qwen3_moe has 8 experts (top-2, renormalized)
    in layers 0 and 2 and a dense MLP in layer 1 (`mlp_only_layers`); mixtral has 4 experts (top-2) in
    both layers; qwen2_moe has 6 experts (top-3, not renormalized) with a gated shared expert, q/k/v
    bias, and a dense MLP in layer 0; olmoe has 8 experts (top-2) in both layers, q/k norms over whole
    rows and `clip_qkv` small enough to clamp; `fused_experts=True` rewrites the weights with the fused 3-D
    expert tensors.
    """
    import transformers as tf

    kw = dict(_BASE)
    if arch == "llama":
        kw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg_cls, model_cls = tf.LlamaConfig, tf.LlamaForCausalLM
    elif arch == "mistral":
        kw["sliding_window"] = 4096
        cfg_cls, model_cls = tf.MistralConfig, tf.MistralForCausalLM
    elif arch == "qwen2":
        kw["tie_word_embeddings"] = True
        cfg_cls, model_cls = tf.Qwen2Config, tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        kw["head_dim"] = 24
        cfg_cls, model_cls = tf.Qwen3Config, tf.Qwen3ForCausalLM
    elif arch == "gemma2":  # sliding / global layers alternate; both soft-caps small enough to bend
        kw.update(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3)
        kw.update(attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
        cfg_cls, model_cls = tf.Gemma2Config, tf.Gemma2ForCausalLM
    elif arch == "gemma3":  # 5 local : 1 global, local RoPE 10k, global 1M with linear scaling
        kw.update(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=6)
        kw.update(final_logit_softcapping=5.0, sliding_window_pattern=3)
        kw["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        }
        cfg_cls, model_cls = tf.Gemma3TextConfig, tf.Gemma3ForCausalLM
    elif arch == "granite":
        kw |= dict(embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.4)
        kw["logits_scaling"] = 3.0
        cfg_cls, model_cls = tf.GraniteConfig, tf.GraniteForCausalLM
    elif arch == "phi3":
        kw |= dict(partial_rotary_factor=0.5, original_max_position_embeddings=256, pad_token_id=0)
        cfg_cls, model_cls = tf.Phi3Config, tf.Phi3ForCausalLM
    elif arch == "phi3-longrope":
        gen = torch.Generator().manual_seed(seed + 7)
        half = kw["hidden_size"] // kw["num_attention_heads"] // 2
        short, long = (1 + 3 * torch.rand(half, generator=gen) for _ in range(2))
        kw |= dict(original_max_position_embeddings=LONGROPE_ORIGINAL, pad_token_id=0)
        kw["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [round(float(x), 4) for x in short],
            "long_factor": [round(float(x), 4) * 4 for x in long],
        }
        cfg_cls, model_cls = tf.Phi3Config, tf.Phi3ForCausalLM
    elif arch == "qwen3_moe":
        kw |= dict(head_dim=24, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2)
        kw |= dict(moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
        cfg_cls, model_cls = tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        kw |= dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
        cfg_cls, model_cls = tf.MixtralConfig, tf.MixtralForCausalLM
    elif arch == "qwen2_moe":
        kw |= dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24)
        kw |= dict(shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0])
        cfg_cls, model_cls = tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM
    elif arch == "olmoe":
        kw |= dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=2.0)
        cfg_cls, model_cls = tf.OlmoeConfig, tf.OlmoeForCausalLM
    else:
        raise ValueError(arch)
    fused_experts = overrides.pop("fused_experts", False)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    with torch.no_grad():  # larger weights than the init default so logits are far from ties
        for name, p in model.named_parameters():
            if name.endswith("bias") or (arch in GEMMA_ARCHS and name.endswith("norm.weight")):
                p.normal_(0, 0.5)  # (Gemma's norms scale by 1 + w, w = 0 at init)
            elif arch in GEMMA_ARCHS and name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.08)  # times sqrt(hidden) = 8: an embedding does not drown the layers
            elif p.dim() > 1:
                p.normal_(0, 0.25)
    model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    if fused_experts:  # the in-memory state dict: 3-D `mlp.experts.gate_up_proj` / `down_proj`
        from safetensors.torch import save_file

        for f in out_dir.glob("*.safetensors"):
            f.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def build_gemma3_multimodal(out_dir: Path, text_dir: Path) -> Path:
    """Save a tiny `Gemma3ForConditionalGeneration` (a one-layer SigLIP vision tower) whose language model
    has the weights of the tiny Gemma3ForCausalLM in `text_dir`; returns `out_dir`."""
    import transformers as tf

    text = tf.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = tf.Gemma3Config(text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    model = tf.Gemma3ForConditionalGeneration(cfg)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.save_pretrained(out_dir)
    return out_dir


def save_char_tokenizer(out_dir: Path, chat_template: str | None = None) -> None:
    """A character-level fast tokenizer over printable ASCII (ids 3..), with <unk>=0, <s>=1, </s>=2,
    and `chat_template` if given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out_dir)


class HFGreedyOracle:
    """Greedy continuation by the transformers model itself: full forward, argmax, append."""

    def __init__(self, model_dir: Path, dtype=torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    @torch.no_grad()
    def greedy_cached(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation the way `generate` runs it: the prompt in one forward pass, then one token
        per pass over the KV cache (what LongRoPE's length rule depends on)."""
        out = self.model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        while len(tokens) < max_new_tokens:
            out = self.model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log_softmax of next-token logits at every position of `ids` -> [len(ids), vocab]."""
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
