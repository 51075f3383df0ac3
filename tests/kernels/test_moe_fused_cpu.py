"""The fused decode MoE call (`kernels/moe_fused_cpu.py`) at every instruction-set level this CPU runs,
against the one torch reference (`SparseMoE.route`'s rule, then `experts_forward`): each routing rule
(softmax then top-k with and without renormalization -- Qwen3-MoE / OLMoE / Qwen2-MoE; Mixtral's top-k then
softmax, which is softmax-top-k renormalized), random sizes with experts that get no rows, token counts
around the decode threshold, expert parallel's local subsets, float32 and bfloat16; each pair's expert LoRA
inside the call (adapters of one and two pages, a projection left out, base rows, pages read through a
layer's strided view of the pool, float32 and bfloat16) against `kernels/reference.py`'s `fused_moe_ref`;
and the MoE layer's dispatch to it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.model.moe_experts as moe_experts
from engine.model.moe_experts import experts_forward, fused_decode_applies
from kernels.moe_fused_cpu import available_isas, fused_moe_cpu
from kernels.moe_lora_meta import ExpertLoRAWeights, MoELoRA
from kernels.reference import fused_moe_ref


def _weights(experts, hidden, inter, dtype, seed, held=None):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, hidden, generator=gen)
    gate_up = torch.randn(held or experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(held or experts, hidden, inter, generator=gen) * inter**-0.5
    return [t.to(dtype) for t in (router, gate_up, down)]


def _reference(x, router, gate_up, down, top_k, norm, rule="softmax_topk", emap=None):
    """The torch path: routing by `rule`, then `experts_forward` (ids through `emap` under EP)."""
    logits = nn.functional.linear(x, router).float()
    if rule == "topk_softmax":  # Mixtral's order: top-k logits, softmax over them
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    local = ids if emap is None else emap[ids]
    return experts_forward(gate_up, down, x, weights.to(x.dtype), local), ids, weights


def _tol(dtype):
    return (2e-5, 2e-5) if dtype == torch.float32 else (3e-2, 3e-2)


RULES = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", True)]


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rule", "norm"), RULES)
@pytest.mark.parametrize("tokens", [1, 3, 15, 16, 17, 40])
def test_matches_torch_reference(isa, dtype, rule, norm, tokens) -> None:
    experts, hidden, inter, top_k = 12, 45, 37, 3  # odd sizes: the kernels' column and lane remainders
    router, gate_up, down = _weights(experts, hidden, inter, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + tokens)).to(dtype)
    want, ids, weights = _reference(x, router, gate_up, down, top_k, norm, rule)
    got_ids, got_w = torch.empty(tokens, top_k, dtype=torch.long), torch.empty(tokens, top_k)
    got = fused_moe_cpu(x, router, gate_up, down, top_k, norm, routing=(got_ids, got_w), isa=isa)
    assert torch.equal(got_ids.sort(1).values, ids.sort(1).values)
    order = torch.argsort(got_ids, 1)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(got_w.gather(1, order), weights.to(dtype).float().gather(1, ids.argsort(1)),
                               rtol=rtol, atol=atol)  # fmt: skip
    if tokens < experts / top_k:  # some experts get no rows
        assert len(set(ids.flatten().tolist())) < experts
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("seed", range(4))
def test_random_sizes(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(2, 40, (1,), generator=gen))
    top_k = int(torch.randint(1, min(experts, 8) + 1, (1,), generator=gen))
    hidden, inter = (int(v) for v in torch.randint(1, 90, (2,), generator=gen))
    tokens = int(torch.randint(1, 20, (1,), generator=gen))
    norm = bool(seed % 2)
    router, gate_up, down = _weights(experts, hidden, inter, torch.float32, seed)
    x = torch.randn(tokens, hidden, generator=gen)
    want, *_ = _reference(x, router, gate_up, down, top_k, norm)
    torch.testing.assert_close(
        fused_moe_cpu(x, router, gate_up, down, top_k, norm), want, rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_local_subset(dtype) -> None:
    """A rank holding experts {1, 4, 6, 7} of 8: other ranks' pairs add nothing (a token with none of its
    experts here gets a zero row), as `experts_forward` drops ids E."""
    local = [1, 4, 6, 7]
    router, gate_up, down = _weights(8, 32, 24, dtype, seed=3, held=len(local))
    emap = torch.full((8,), len(local), dtype=torch.long)
    emap[local] = torch.arange(len(local))
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    want, ids, _ = _reference(x, router, gate_up, down, 2, True, emap=emap)
    got = fused_moe_cpu(x, router, gate_up, down, 2, True, expert_map=emap)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    none_here = (emap[ids] == len(local)).all(1)
    assert none_here.any() and (got[none_here] == 0).all()


def test_threads_same_bits_and_strided_rows() -> None:
    router, gate_up, down = _weights(16, 64, 40, torch.float32, seed=1)
    wide = torch.randn(7, 80, generator=torch.Generator().manual_seed(2))
    outs = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(fused_moe_cpu(wide[:, :64], router, gate_up, down, 4, False))
        finally:
            torch.set_num_threads(prev)
    assert torch.equal(outs[0], outs[1])
    want, *_ = _reference(wide[:, :64].contiguous(), router, gate_up, down, 4, False)
    torch.testing.assert_close(outs[0], want, rtol=2e-5, atol=2e-5)


# adapter -> (gate_up pages, down pages): two pages, one page, gate_up only, down only; the projections'
# tables of different widths (the call sizes its scratch by the wider)
LORA_PAGES = [([1, 3], [0]), ([2], [4, 1, 3]), ([0], []), ([], [2])]


def _lora_weights(layer, experts, fin, fout, rank, pages, gen, dtype=torch.float32) -> ExpertLoRAWeights:
    """Layer `layer`'s view of a 5-page, 3-layer pool (as `ExpertLoRAStep.kernel_lora` passes it: the page
    stride spans the other layers), with `pages` per adapter."""
    a = (torch.randn(5, 3, experts, rank, fin, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(5, 3, experts, fout, rank, generator=gen) * 0.3).to(dtype)
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [-1] * (width - len(p)) for p in pages], dtype=torch.int32)
    return ExpertLoRAWeights(a[:, layer], b[:, layer], table, torch.rand(len(pages), generator=gen) + 0.5)


def _lora_case(tokens, experts, hidden, inter, rank, seed, held=None, dtype=torch.float32):
    """(x, router, gate_up, down, lora): every adapter of LORA_PAGES and base rows among the tokens."""
    router, gate_up, down = _weights(experts, hidden, inter, dtype, seed, held)
    gen = torch.Generator().manual_seed(50 + seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    count = len(LORA_PAGES)
    token_adapter = torch.arange(tokens) % (count + 1)  # count: a base row
    held = held or experts
    gu = _lora_weights(1, held, hidden, 2 * inter, rank, [g for g, _ in LORA_PAGES], gen, dtype)
    dn = _lora_weights(1, held, inter, hidden, rank, [d for _, d in LORA_PAGES], gen, dtype)
    return x, router, gate_up, down, MoELoRA(token_adapter, count, gu, dn)


def _routed(x, router, gate_up, down, top_k, lora, emap=None):
    """(the fused call's output, the reference on the routing it chose)."""
    ids, w = torch.empty(x.shape[0], top_k, dtype=torch.long), torch.empty(x.shape[0], top_k)
    got = fused_moe_cpu(x, router, gate_up, down, top_k, True, emap, routing=(ids, w), lora=lora)
    if emap is not None:  # expert parallel: only this rank's pairs, at their local ids
        local = emap[ids]
        here = local < gate_up.shape[0]
        want = fused_moe_ref(x, gate_up, down, w.masked_fill(~here, 0), local.masked_fill(~here, 0), lora)
        return got, want
    return got, fused_moe_ref(x, gate_up, down, w, ids, lora)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "rank", "hidden", "inter"),
    [(1, 4, 45, 37), (5, 16, 45, 37), (16, 8, 100, 200), (40, 4, 45, 37)],
)  # 100 / 200: each block's interleaved chains, a leftover vector and a masked tail all run
def test_expert_lora_matches_reference(isa, dtype, tokens, rank, hidden, inter) -> None:
    x, router, gate_up, down, lora = _lora_case(tokens, 12, hidden, inter, rank, seed=tokens, dtype=dtype)
    got, want = _routed(x, router, gate_up, down, 3, lora)
    rtol, atol = _tol(dtype)
    if dtype == torch.bfloat16:  # the reference is float32 throughout; the call rounds each op's output
        atol = 1e-2 * float(want.float().abs().max())  # (the deltas here are large: outputs up to ~45)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    base = fused_moe_cpu(x, router, gate_up, down, 3, True)
    adapted = lora.token_adapter < lora.num_adapters
    if adapted.any():  # the adapters change every adapted row, and only those
        assert (got.float() - base.float())[adapted].abs().amax(1).min() > 5e-2
    assert torch.equal(got[~adapted], base[~adapted])


def test_expert_lora_one_projection_threads_and_expert_parallel() -> None:
    """`down` without LoRA; a -1 inside a page table is skipped, not the table's end (as the reference and
    the Triton kernel read it); the same bits at 1 and 2 threads; a rank holding 4 of 8 experts (its pages
    are its experts' slices) adds only its pairs' deltas."""
    x, router, gate_up, down, lora = _lora_case(9, 8, 32, 24, 8, seed=7)
    lora.down = None
    got, want = _routed(x, router, gate_up, down, 2, lora)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert lora.gate_up is not None
    lora.gate_up.pages[0] = torch.tensor([-1, 3], dtype=torch.int32)  # adapter 0: its second page only
    got, want = _routed(x, router, gate_up, down, 2, lora)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    outs = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(_routed(x, router, gate_up, down, 2, lora)[0])
        finally:
            torch.set_num_threads(prev)
    assert torch.equal(outs[0], outs[1])
    local = [1, 4, 6, 7]
    x, router, gate_up, down, lora = _lora_case(9, 8, 32, 24, 8, seed=8, held=len(local))
    emap = torch.full((8,), len(local), dtype=torch.long)
    emap[local] = torch.arange(len(local))
    got, want = _routed(x, router, gate_up, down, 2, lora, emap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_expert_lora_bad_input_is_a_value_error() -> None:
    x, router, gate_up, down, lora = _lora_case(4, 8, 32, 24, 4, seed=9)
    with pytest.raises(ValueError, match=r"pages must be torch\.bfloat16"):  # float32 pages, bfloat16 weights
        fused_moe_cpu(*(t.bfloat16() for t in (x, router, gate_up, down)), 2, True, lora=lora)
    short = MoELoRA(lora.token_adapter[:2], lora.num_adapters, lora.gate_up, lora.down)
    with pytest.raises(ValueError, match="token_adapter has shape"):
        fused_moe_cpu(x, router, gate_up, down, 2, True, lora=short)
    over = MoELoRA(lora.token_adapter + 5, lora.num_adapters, lora.gate_up, lora.down)
    with pytest.raises(ValueError, match=r"token_adapter must lie in \[0, 4\]"):
        fused_moe_cpu(x, router, gate_up, down, 2, True, lora=over)
    assert lora.gate_up is not None
    past = ExpertLoRAWeights(lora.gate_up.a, lora.gate_up.b, lora.gate_up.pages + 5, lora.gate_up.scale)
    with pytest.raises(ValueError, match=r"page ids must lie in \[-1, 5\)"):
        fused_moe_cpu(x, router, gate_up, down, 2, True, lora=MoELoRA(lora.token_adapter, 4, past, None))
    strided = ExpertLoRAWeights(lora.gate_up.a.transpose(2, 3), lora.gate_up.b, lora.gate_up.pages,
                                lora.gate_up.scale)  # fmt: skip
    with pytest.raises(ValueError):
        fused_moe_cpu(x, router, gate_up, down, 2, True, lora=MoELoRA(lora.token_adapter, 4, strided, None))


def test_bad_input_is_a_value_error() -> None:
    router, gate_up, down = _weights(4, 8, 6, torch.float32, seed=0)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe_cpu(x.double(), router, gate_up, down, 2, True)
    with pytest.raises(ValueError, match="shapes"):
        fused_moe_cpu(torch.randn(2, 9), router, gate_up, down, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_cpu(x, router, gate_up, down, 5, True)
    with pytest.raises(ValueError, match="expert_map"):
        fused_moe_cpu(x, router, gate_up[:2].contiguous(), down[:2].contiguous(), 2, True)
    assert fused_moe_cpu(x[:0], router, gate_up, down, 2, True).shape == (0, 8)


class _Adapts:
    """An expert-LoRA hook stub: adapts the layers in `layers`, its pages of `page_dtype`."""

    num_adapters = 1

    def __init__(self, layers, page_dtype=torch.bfloat16):
        self.layers, self.page_dtype = layers, page_dtype

    def adapts(self, layer: int) -> bool:
        return layer in self.layers

    def kernel_lora(self, layer, num_rows, device):
        raise AssertionError("only fused_decode_applies is asked")


def test_dispatch_decode_sized_steps_and_float32_expert_lora(monkeypatch) -> None:
    _, gate_up, down = _weights(4, 8, 6, torch.float32, seed=0)
    x = torch.randn(moe_experts.FUSED_MAX_TOKENS, 8)
    assert fused_decode_applies(x, gate_up, down, None, 0, 2)
    assert fused_decode_applies(x, gate_up, down, _Adapts({1}), 0, 2)  # another layer's expert LoRA
    assert not fused_decode_applies(x, gate_up, down, _Adapts({0}), 0, 2)  # bfloat16 pages: op by op
    assert fused_decode_applies(x, gate_up, down, _Adapts({0}, torch.float32), 0, 2)  # float32: inside
    bf = [t.bfloat16() for t in (x, gate_up, down)]
    assert not fused_decode_applies(*bf, _Adapts({0}, torch.float32), 0, 2)  # pages of another dtype
    assert fused_decode_applies(*bf, _Adapts({0}), 0, 2)  # bfloat16 pages of a bfloat16 model: inside
    assert fused_decode_applies(*bf, _Adapts({1}, torch.float32), 0, 2)
    monkeypatch.setattr(moe_experts, "FUSED_LORA", False)
    assert not fused_decode_applies(x, gate_up, down, _Adapts({0}, torch.float32), 0, 2)
    monkeypatch.setattr(moe_experts, "FUSED_LORA", True)
    over = torch.randn(2 * moe_experts.FUSED_ROWS_PER_EXPERT + 1, 8)  # top-2 over 4 experts: past the bound
    assert over.shape[0] > moe_experts.FUSED_MAX_TOKENS
    assert not fused_decode_applies(over, gate_up, down, None, 0, 2)
    # past FUSED_MAX_TOKENS tokens while the pairs average <= FUSED_ROWS_PER_EXPERT rows an expert
    _, gu8, dn8 = _weights(8, 8, 6, torch.float32, seed=1)
    fits = torch.randn(8 * moe_experts.FUSED_ROWS_PER_EXPERT // 2, 8)  # top-2 over 8 experts: the bound
    assert fits.shape[0] > moe_experts.FUSED_MAX_TOKENS
    assert fused_decode_applies(fits, gu8, dn8, None, 0, 2)
    assert not fused_decode_applies(fits, gu8, dn8, None, 0, 3)
    assert not fused_decode_applies(torch.randn(fits.shape[0] + 1, 8), gu8, dn8, None, 0, 2)
    assert not fused_decode_applies(x[:0], gate_up, down, None, 0, 2)
    assert not fused_decode_applies(x.double(), gate_up.double(), down.double(), None, 0, 2)
    monkeypatch.setattr(moe_experts, "FUSED_DECODE", False)
    assert not fused_decode_applies(x, gate_up, down, None, 0, 2)
