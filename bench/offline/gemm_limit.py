"""The "GEMM limit": time of the dense matmuls alone for a run's decode steps.

For every decode step with batch b it computes, with the engine's own (packed) weights,
`x_b @ W.T` for each projection of each layer (q|k|v, o, gate|up, down) and the LM head — the work no
implementation of the forward pass can avoid. Attention, norms, LoRA, sampling and bookkeeping are not
included, so `gemm_limit / decode_time` is the fraction of the ideal a real engine reaches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def model_weights(model) -> list[tuple[torch.Tensor, bool]]:
    """Every weight a decode step multiplies by, in forward order (engine `LlamaForCausalLM`), and whether
    it is packed for oneDNN (`engine/model/cpu_gemm.py`): the limit uses the engine's own fastest form."""
    ws = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            ws.append((proj.weight, proj.packed))
    if model.packed_head is not None:
        ws.append((model.packed_head, True))
    else:
        ws.append((model.embed_tokens.weight if model.lm_head is None else model.lm_head, False))
    return ws


@torch.inference_mode()
def gemm_limit_seconds(model, batch_sizes: Sequence[int], repeats: int = 3) -> float:
    """Best-of-`repeats` wall time of the dense matmuls for decode steps of the given batch sizes."""
    from engine.model.cpu_gemm import packed_linear

    weights = model_weights(model)
    inputs = {
        b: {w.shape[1]: torch.randn(b, w.shape[1], dtype=w.dtype) for w, _ in weights}
        for b in set(batch_sizes)
    }
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for b in batch_sizes:
            xs = inputs[b]
            for w, packed in weights:
                if packed:
                    packed_linear(xs[w.shape[1]], w, None)
                else:
                    F.linear(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return best
