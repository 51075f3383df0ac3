"""The engine's CPU implementations agree with `kernels.reference`, the single definition of each op."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.lora.adapter_checkpoint import PROJECTIONS, AdapterCheckpoint, LoRAModuleWeights, module_features
from engine.lora.pool import AdapterPool
from engine.lora.step_context import CpuLoRAContext, token_segments
from engine.model_config import ModelConfig
from kernels.lora_meta import build_lora_batch_meta
from kernels.reference import (
    lora_expand_ref,
    lora_shrink_ref,
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
)
from tests.engine.attention_case import attention_case

CFG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 50,
    }
)


def _adapter(digest: str, ranks: dict[str, int], gen: torch.Generator) -> AdapterCheckpoint:
    mods = []
    for layer in range(CFG.num_layers):
        for m, r in ranks.items():
            fin, fout = module_features(CFG, m)
            a, b = torch.randn(r, fin, generator=gen), torch.randn(fout, r, generator=gen)
            mods.append(LoRAModuleWeights(layer, m, r, 2.0 * r, 2.0 + layer, a, b))
    return AdapterCheckpoint(digest, max(ranks.values()), 1.0, tuple(ranks), False, 0, None, tuple(mods))


# Requests in flat-batch order: token counts and adapter index (None = base model).
LAYOUTS = {
    "mixed": ([1, 1, 1, 1, 5, 3], [0, 0, None, 2, 1, 0]),  # decodes, a lone long run, a short run
    "long-runs": ([6, 1, 4, 5, 2, 7], [0, None, 1, 2, 0, 1]),  # prefill-like chunks, a base row, 2 rows
}


@pytest.mark.parametrize(
    ("native", "pool_dtype", "act"),
    [
        (False, torch.float32, torch.float32),
        (False, torch.float16, torch.float32),
        (True, torch.float32, torch.float32),
        (True, torch.bfloat16, torch.float32),
        (True, torch.bfloat16, torch.bfloat16),
    ],
    ids=["torch", "torch-f16-pages", "native", "native-bf16-pages", "native-bf16"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group", [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",)])
def test_cpu_lora_context_matches_reference(group, native, pool_dtype, act, layout):
    """Both CPU paths (torch gather + bmm, native kernel), activations of the model's dtype (float32 or
    bfloat16) over pages of any dtype."""
    gen = torch.Generator().manual_seed(0)
    pool = AdapterPool(CFG, num_pages=12, page_rank=4, max_lora_rank=12, dtype=pool_dtype, device="cpu")
    ads = [
        pool.upload(_adapter("a", {"q_proj": 3, "v_proj": 12, "gate_proj": 5, "down_proj": 1}, gen)),
        pool.upload(_adapter("b", {m: 8 for m in PROJECTIONS}, gen)),
        pool.upload(_adapter("c", {"k_proj": 4, "up_proj": 9}, gen)),
    ]
    counts, which = LAYOUTS[layout]
    adapters = [None if i is None else ads[i] for i in which]
    x = torch.randn(sum(counts), module_features(CFG, group[0])[0], generator=gen).to(act)
    width = sum(module_features(CFG, m)[1] for m in group)
    y0 = torch.randn(x.shape[0], width, generator=gen).to(act)
    layer = 1
    y = y0.clone()
    ctx = CpuLoRAContext(pool, token_segments(counts, adapters), native=native)
    if not native:  # long runs as GEMMs, short ones row by row
        assert ctx.segments and ctx.gather is not None
    ctx.apply(layer, group, x, y)
    if native:  # every run through the kernel (its plan made by the first apply)
        assert ctx.native is not None and not ctx.segments and ctx.gather is None

    pairs = zip(adapters, counts, strict=True)
    slots = torch.tensor([-1 if a is None else a.slot for a, n in pairs for _ in range(n)])
    meta = build_lora_batch_meta(slots.to(torch.int32))
    first = PROJECTIONS.index(group[0])
    sl = slice(first, first + len(group))
    v = torch.zeros(len(group), x.shape[0], 12)
    lora_shrink_ref(
        x,
        [pool.a[m][:, layer] for m in range(sl.start, sl.stop)],
        pool.page_table[sl],
        pool.ranks[layer, sl],
        meta,
        v,
    )
    y_ref = y0.clone()
    lora_expand_ref(
        v,
        [pool.b[m][:, layer] for m in range(sl.start, sl.stop)],
        pool.page_table[sl],
        pool.ranks[layer, sl],
        pool.scalings[layer, sl],
        meta,
        y_ref,
    )
    tol = 1e-4 if act == torch.float32 else 2e-2  # bfloat16 y: float32 sums in another order, one rounding
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    row_adapters = [i for i, n in zip(which, counts, strict=True) for _ in range(n)]
    base_rows = [r for r, i in enumerate(row_adapters) if i is None]
    assert torch.equal(y[base_rows], y0[base_rows])  # base-model tokens are untouched
    assert not torch.allclose(y, y0)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_torch_attention_matches_reference(native):
    # two decodes, then prefill chunks of 6 and 7 tokens
    c = attention_case(1, 20, 4, 2, 6, 8, seq_lens=[5, 9, 13, 7], q_lens=[1, 1, 6, 7], num_decodes=2)
    q, k_cache, v_cache, tables, meta = c.q, c.k_cache, c.v_cache, c.tables, c.meta
    backend = TorchAttentionBackend(native=native)
    out = backend.attend(q, k_cache, v_cache, meta, 0.3)
    assert (backend.native.step(q, k_cache, meta) is not None) == native
    ref_dec = paged_attention_decode_ref(q[:2], k_cache, v_cache, tables[:2], meta.seq_lens[:2], 0.3)
    starts = meta.query_start_loc[2:] - 2
    ref_pre = paged_attention_prefill_ref(q[2:], k_cache, v_cache, tables[2:], starts, meta.seq_lens[2:], 0.3)
    torch.testing.assert_close(out[:2], ref_dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2:], ref_pre, rtol=1e-5, atol=1e-5)
