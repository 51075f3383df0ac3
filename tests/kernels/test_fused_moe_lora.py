"""Expert LoRA in the Triton fused MoE (interpreted) vs the torch reference: mixed adapters of different
ranks (several pages, a projection left out) beside base rows, decode- and prefill-sized; the reference's
LoRA vs a per-pair oracle."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import fused_moe
from kernels.moe_align import align_pairs
from kernels.moe_lora_meta import ExpertLoRAWeights, MoELoRA, group_ids
from kernels.reference import fused_moe_ref

H, INTER, E = 48, 40, 8  # not powers of two: N and K masking
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-2, 4e-2)}
# adapter -> (gate_up pages, down pages): several pages (rank 2R), one page, gate_up only, down only
PAGES = [([1, 3], [0]), ([2], [4, 1]), ([0], []), ([], [2])]


def _weights(fin: int, fout: int, rank: int, pages: list[list[int]], dtype, gen) -> ExpertLoRAWeights:
    a = (torch.randn(5, E, rank, fin, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(5, E, fout, rank, generator=gen) * 0.3).to(dtype)
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [-1] * (width - len(p)) for p in pages], dtype=torch.int32)
    scale = torch.rand(len(pages), generator=gen) + 0.5
    return ExpertLoRAWeights(a, b, table, scale)


def _case(num_tokens: int, top_k: int, rank: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    w_gate_up = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.2).to(dtype)
    w_down = (torch.randn(E, H, INTER, generator=gen) * 0.2).to(dtype)
    weights, ids = torch.topk(torch.randn(num_tokens, E, generator=gen).softmax(-1), top_k, dim=-1)
    num_adapters = len(PAGES)
    token_adapter = torch.randint(0, num_adapters + 1, (num_tokens,), generator=gen)  # A: base rows
    token_adapter[0] = num_adapters if num_tokens > 1 else 1  # one decode row: two-page down LoRA
    if num_tokens > 1:
        token_adapter[1] = 0
    gate_up = _weights(H, 2 * INTER, rank, [g for g, _ in PAGES], dtype, gen)
    down = _weights(INTER, H, rank, [d for _, d in PAGES], dtype, gen)
    lora = MoELoRA(token_adapter, num_adapters, gate_up, down)
    return (x, w_gate_up, w_down, weights.to(dtype), ids), lora


def _pair_oracle(case, lora: MoELoRA) -> torch.Tensor:
    """Each (token, choice) pair on its own in float64, the adapter's pages applied one by one."""
    x, w_gu, w_d, weights, ids = (t.double() if t.is_floating_point() else t for t in case)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        a = int(lora.token_adapter[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])

            def delta(w, z, a=a, e=e):
                if a == lora.num_adapters or w is None:
                    return 0
                return sum(
                    float(w.scale[a]) * (w.b[p, e].double() @ (w.a[p, e].double() @ z))
                    for p in w.pages[a].tolist()
                    if p >= 0
                )

            gu = w_gu[e] @ x[t] + delta(lora.gate_up, x[t])
            h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            out[t] += weights[t, j] * (w_d[e] @ h + delta(lora.down, h))
    return out


def test_reference_lora_matches_pair_oracle() -> None:
    case, lora = _case(11, 3, 4, torch.float32)
    torch.testing.assert_close(
        fused_moe_ref(*case, lora=lora).double(), _pair_oracle(case, lora), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "rank"), [(1, 2, 4), (5, 4, 16), (37, 2, 4), (20, 1, 8)],
    ids=["decode-1", "decode-5-top4-r16", "prefill-37", "prefill-20-top1-r8"],
)  # fmt: skip
def test_lora_matches_reference(num_tokens, top_k, rank, dtype) -> None:
    case, lora = _case(num_tokens, top_k, rank, dtype, seed=num_tokens)
    out = fused_moe(*case, lora=lora)
    ref = fused_moe_ref(*case, lora=lora)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    base = fused_moe_ref(*case)
    adapted = lora.token_adapter < lora.num_adapters
    assert (ref - base)[adapted].abs().amax(1).min() > 0.05  # the adapters change every adapted row
    torch.testing.assert_close(out[~adapted].float(), base[~adapted].float(), rtol=rtol, atol=atol)


def test_one_projection_without_lora() -> None:
    """`down` None: only gate|up is adapted (the pass without LoRA takes the plain kernel)."""
    case, lora = _case(9, 2, 4, torch.float32, seed=4)
    lora.down = None
    torch.testing.assert_close(
        fused_moe(*case, lora=lora), fused_moe_ref(*case, lora=lora), rtol=1e-5, atol=1e-5
    )


def test_bad_lora_inputs_are_refused() -> None:
    case, lora = _case(6, 2, 4, torch.float32, seed=5)
    bad = MoELoRA(lora.token_adapter[:3], lora.num_adapters, lora.gate_up, lora.down)
    with pytest.raises(ValueError, match="token_adapter has shape"):
        fused_moe(*case, lora=bad)
    over = MoELoRA(lora.token_adapter + 10, lora.num_adapters, lora.gate_up, lora.down)
    with pytest.raises(ValueError, match=r"token_adapter must lie in \[0, 4\]"):
        fused_moe(*case, lora=over)
    plain = align_pairs(case[4], E, 16)  # built without the adapter groups
    with pytest.raises(ValueError, match="alignment was built"):
        fused_moe(*case, alignment=plain, lora=lora)
    grouped = align_pairs(group_ids(case[4], lora), E * lora.groups, 16)
    torch.testing.assert_close(
        fused_moe(*case, alignment=grouped, lora=lora), fused_moe_ref(*case, lora=lora), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 6, 37])
def test_local_subset_drops_other_ranks_pairs(with_lora, num_tokens) -> None:
    """Expert parallel: the weights are one rank's experts, id E marks another rank's; those pairs add
    nothing (with and without expert LoRA), a token with no local expert gets a zero row."""
    case, lora = _case(num_tokens, 3, 4, torch.float32, seed=7 + num_tokens)
    x, w_gu, w_d, weights, ids = case
    other = torch.rand(ids.shape, generator=torch.Generator().manual_seed(num_tokens)) < 0.4
    other[0] = True
    local_ids = ids.masked_fill(other, E)
    use = lora if with_lora else None
    out = fused_moe(x, w_gu, w_d, weights, local_ids, lora=use, local_subset=True)
    ref = fused_moe_ref(x, w_gu, w_d, weights.masked_fill(other, 0), ids, lora=use)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out[0] == 0).all() and (num_tokens == 1 or out[1:].abs().amax() > 0.05)
    with pytest.raises(ValueError, match="lie in"):
        fused_moe(x, w_gu, w_d, weights, local_ids, lora=use)
