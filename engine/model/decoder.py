"""The decoder blocks every family builds on, over a flat token batch with a paged KV cache.

`DecoderForCausalLM` is a pre-norm decoder stack (embeddings, layers of attention and a gated MLP, final
RMSNorm, LM head), which is Llama's; a family subclasses what differs (`engine/model/family.py`), e.g.
Granite's multipliers. Variants that are configuration, not code: q/k/v bias (Qwen2), o and MLP biases
(Llama's `attention_bias`, `mlp_bias`), RMSNorm of each
q and k head before RoPE (Qwen3), a tied LM head, RoPE scaling and partial rotary (`rope.py`).

On the CPU (`engine/model/cpu_fused.py`) the small ops between the projections are fused native calls
(`kernels/fused_cpu.py`): the residual add with the next RMSNorm, RoPE (with Qwen3's q/k norm) in place on
the packed qkv output (partial rotary too), and SiLU(gate) * up. Elsewhere (CUDA), and for a model a
family marks as beyond the native calls (`fused_problem`, logged once), they are the torch formulas below.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.model.cpu_fused import use_fused
from engine.model.cpu_gemm import can_pack, pack, packed_linear
from engine.model.layers import ForwardBatch, RMSNorm, vocab_lora
from engine.model.linear import LoRAStepContext, ProjectionLinear
from engine.model.rope import RotaryEmbedding, apply_rope, rotary_dim
from engine.model_config import ModelConfig
from kernels.fused_cpu import FusedStep

log = logging.getLogger(__name__)


class Attention(nn.Module):
    """q|k|v projection, RoPE, paged attention, o projection; `scale` defaults to head_dim^-0.5.

    `window`: the layer's sliding window (it attends to its last `window` positions; 0 none), by default
    the model's `sliding_window` (Mistral: every layer); `softcap` > 0: attention-logit soft-capping.
    `head_qk_norm`: `q_norm` / `k_norm` norm each head (Qwen3); a family whose norms are over the whole
    q and k rows (OLMoE) turns it off and applies them in `project_qkv`."""

    head_qk_norm = True

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        rope: RotaryEmbedding,
        scale: float | None = None,
        window: int | None = None,
        softcap: float = 0.0,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = ProjectionLinear(
            cfg.hidden_size,
            ("q_proj", "k_proj", "v_proj"),
            (cfg.q_size, cfg.kv_size, cfg.kv_size),
            layer,
            bias=cfg.qkv_bias,
        )
        self.o_proj = ProjectionLinear(cfg.q_size, ("o_proj",), (cfg.hidden_size,), layer, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.scale = cfg.head_dim**-0.5 if scale is None else scale
        self.window = (cfg.sliding_window or 0) if window is None else window
        self.softcap = softcap

    def forward(self, x, rope_tables, kv: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, backend):
        """`rope_tables`: the per-step (cos2, sin2) of the torch path, or the step's fused CPU ops."""
        t = x.shape[0]
        qkv = self.project_qkv(x, batch.lora)
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = nh * d, nkv * d
        if isinstance(rope_tables, FusedStep):  # q and k normed (Qwen3) and rotated in place in qkv
            qk_norm = None
            if self.head_qk_norm and self.q_norm is not None and self.k_norm is not None:
                qk_norm = (self.q_norm.weight, self.k_norm.weight, nh, self.q_norm.eps)
            rope_tables.rope_(qkv, nh + nkv, qk_norm, d)
            q, k, v = qkv.view(t, nh + 2 * nkv, d).split((nh, nkv, nkv), dim=1)  # views: one call
        else:
            v = qkv[:, q_size + kv_size :].view(t, nkv, d)
            if self.head_qk_norm and self.q_norm is not None and self.k_norm is not None:
                q = self._rope(self.q_norm(qkv[:, :q_size].view(t, nh, d)), rope_tables)
                k = self._rope(self.k_norm(qkv[:, q_size : q_size + kv_size].view(t, nkv, d)), rope_tables)
            else:  # q and k are adjacent columns: rotate both heads' blocks in one pass
                qk = self._rope(qkv[:, : q_size + kv_size].view(t, nh + nkv, d), rope_tables)
                q, k = qk[:, :nh], qk[:, nh:]
        backend.write_kv(k, v, kv[0], kv[1], batch.attn)
        o = backend.attend(q, kv[0], kv[1], batch.attn, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(t, q_size), batch.lora)

    def project_qkv(self, x: torch.Tensor, lora: LoRAStepContext | None) -> torch.Tensor:
        """The packed q|k|v rows of `x` (with their LoRA deltas); a family may transform them (OLMoE)."""
        return self.qkv_proj(x, lora)

    def _rope(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the first `rope.rotary_dim` values of each head of x [T, H, D]; the rest pass as is."""
        rd = self.rope.rotary_dim
        if rd == x.shape[-1]:
            return apply_rope(x, tables)
        return torch.cat((apply_rope(x[..., :rd], tables), x[..., rd:]), dim=-1)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate|up packed in one projection."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        inter = cfg.intermediate_size
        names, bias = ("gate_proj", "up_proj"), cfg.mlp_bias
        self.gate_up_proj = ProjectionLinear(cfg.hidden_size, names, (inter, inter), layer, bias=bias)
        self.down_proj = ProjectionLinear(inter, ("down_proj",), (cfg.hidden_size,), layer, bias=bias)
        self.inter = inter

    def forward(self, x: torch.Tensor, lora: LoRAStepContext | None, fused: FusedStep | None = None):
        gu = self.gate_up_proj(x, lora)
        if fused is not None:  # the CPU's native SiLU(gate) * up
            h = fused.silu_mul(gu)
        else:
            h = nn.functional.silu(gu[:, : self.inter]) * gu[:, self.inter :]
        return self.down_proj(h, lora)


class DecoderLayer(nn.Module):
    """x += attn(norm(x)) * m; x += mlp(norm(x)) * m, with `residual_multiplier` m (None: 1, Granite's)."""

    residual_multiplier: float | None = None

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.make_attention(cfg, layer, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer)

    def make_attention(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> Attention:
        """The layer's attention block (a family may change its scale)."""
        return Attention(cfg, layer, rope)

    def forward(self, x, rope_tables, kv, batch: ForwardBatch, backend):
        m = self.residual_multiplier
        a = self.self_attn(self.input_layernorm(x), rope_tables, kv, batch, backend)
        x = x + (a if m is None else a * m)
        f = self.mlp(self.post_attention_layernorm(x), batch.lora)
        return x + (f if m is None else f * m)

    def forward_fused(self, step: FusedStep, residual, h, kv, batch: ForwardBatch, backend, next_norm):
        """CPU: `h` is this layer's normed input; adds both branches into `residual` in place and returns
        the next layer's normed input (`next_norm` of the updated residual), or None without `next_norm`.
        """
        m = self.residual_multiplier
        attn = self.self_attn(h, step, kv, batch, backend)
        if m is not None:
            attn.mul_(m)
        h = self.post_attention_layernorm.fused(step, residual, attn)
        out = self.mlp(h, batch.lora, step)
        if m is not None:
            out.mul_(m)
        if next_norm is None:
            residual.add_(out)
            return None
        return next_norm.fused(step, residual, out)


class DecoderForCausalLM(nn.Module):
    """Decoder stack + LM head; `forward` returns float32 logits for `batch.logits_indices` only.

    A family overrides `layer_cls`, `embed` (e.g. scaled embeddings) or `head` (e.g. scaled logits)."""

    layer_cls: type[DecoderLayer] = DecoderLayer
    activations: tuple[str, ...] = ("silu",)  # the `hidden_act` values the family's MLP computes

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.extra.get("hidden_act", "silu") not in self.activations:
            only = ", ".join(self.activations)
            raise ValueError(f"hidden_act {cfg.extra['hidden_act']!r} is not supported (only {only})")
        self.config = cfg
        # `_weight` skips the random init (and with it, on the meta device, an import of torch._dynamo
        # that costs over a second of engine start-up); the loader fills every weight.
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        self.embed_tokens.weight.requires_grad_(False)
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, rotary_dim(cfg)
        )
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, self.rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        # False: the torch formulas on the CPU too (benchmarks compare both; and see `fused_problem`)
        self.fused_cpu_ops = True
        self.packed_head: torch.Tensor | None = None  # the LM head in oneDNN's layout (`pack_cpu_gemms`)
        # why the fused CPU ops cannot run this model (None: they can); a family sets it for what they lack
        self.fused_problem: str | None = None
        # why plain decode steps cannot replay from CUDA graphs (None: they can; `engine/decode_graphs.py`)
        self.graph_problem: str | None = None
        self._fallback_logged = False

    def embed(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """The token embeddings the first layer reads."""
        return self.lookup(input_ids, batch)

    def lookup(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """The embedding rows of `input_ids`, plus the step's embedding-LoRA deltas on adapted rows (the
        `embed_tokens` module's output, before any family scaling)."""
        x = self.embed_tokens(input_ids)
        vocab = vocab_lora(batch)
        if vocab is not None:
            vocab.embed(input_ids, x)
        return x

    def logits(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """The LM head applied to the final-normed rows `x` (`batch.logits_indices`' rows), in the
        model's dtype, plus the step's LM-head-LoRA deltas on adapted rows."""
        if self.packed_head is not None:
            out = packed_linear(x, self.packed_head, None)
        else:
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
            out = nn.functional.linear(x, head)
        vocab = vocab_lora(batch)
        if vocab is not None:
            assert batch is not None, "a vocabulary LoRA comes with its batch"
            vocab.head(x, out, batch.logits_indices)
        return out

    def head(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """float32 logits of the final-normed rows `x`."""
        return self.logits(x, batch).float()

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.embed(batch.input_ids, batch)
        if self.fused_problem is None and use_fused(x, self.fused_cpu_ops):
            step = FusedStep(x.dtype, batch.positions, self.rope.cos, self.rope.sin)
            x = self._layers_fused(step, x, batch, kv_caches, backend)
            x = self.norm.fused(step, x[batch.logits_indices], None)
        else:
            if self.fused_problem is not None and not self._fallback_logged and use_fused(x):
                log.warning("fused CPU ops fall back to torch ops for this model: %s", self.fused_problem)
                self._fallback_logged = True
            rope_tables = self.rope.tables(batch.positions)  # gathered once, shared by every layer
            for layer, kv in zip(self.layers, kv_caches, strict=True):
                x = layer(x, rope_tables, kv, batch, backend)
            x = self.norm(x[batch.logits_indices])
        return self.head(x, batch)

    def pack_cpu_gemms(self) -> bool:
        """On a CPU in float32 (or bfloat16 the CPU computes natively), pack every projection's weight and
        the LM head for oneDNN (`engine/model/cpu_gemm.py`); returns whether it did. Call once, after the
        weights are loaded."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        if not can_pack(head.device, head.dtype):
            return False
        for module in self.modules():
            if isinstance(module, ProjectionLinear):
                module.pack_weight()
        self.packed_head = pack(head)
        if self.lm_head is not None:  # untied: the dense head is read by nothing else
            self.lm_head = nn.Parameter(self.packed_head, requires_grad=False)
        return True

    def _layers_fused(self, step: FusedStep, x: torch.Tensor, batch: ForwardBatch, kv_caches, backend):
        """The decoder stack on the fused CPU path: `x` (the embeddings) is the residual stream, updated in
        place; returns it after the last layer (before the final norm)."""
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        h = layers[0].input_layernorm.fused(step, x, None)
        for i, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            h = layer.forward_fused(step, x, h, kv, batch, backend, nxt)
        return x
