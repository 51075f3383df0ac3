"""The decode rows' expert-LoRA kernel (`kernels/moe_lora_pairs_cpu.py`) at every instruction-set level
this CPU runs, against the torch path it replaces (gathered pages, two `bmm`s, `index_add_`): odd sizes
(lane remainders), several pairs on one row (they add in order), pages of other entries untouched, and
its input checks; and `ExpertLoRAStep.add_pairs` with the kernel on and off."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemm_cpu import available_isas
from kernels.moe_lora_pairs_cpu import lora_pairs_cpu


def _case(seed: int, entries=7, pr=4, fin=37, fout=29, rows=5, pairs=9):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(entries, pr, fin, generator=g)
    b = torch.randn(entries, fout, pr, generator=g)
    x = torch.randn(rows, fin, generator=g)
    out = torch.randn(rows, fout, generator=g)
    pages = torch.randint(0, entries, (pairs,), generator=g)
    at = torch.randint(0, rows, (pairs,), generator=g)
    scales = torch.rand(pairs, generator=g) * 2
    return x, a, b, pages, at, scales, out


def _torch(x, a, b, pages, at, scales, out):
    """The torch path of `ExpertLoRAStep.add_pairs`."""
    v = torch.bmm(x.index_select(0, at).unsqueeze(1), a.index_select(0, pages).transpose(1, 2))
    v.mul_(scales.view(-1, 1, 1))
    return out.clone().index_add_(0, at, torch.bmm(v, b.index_select(0, pages).transpose(1, 2)).squeeze(1))


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_torch_path(isa, seed) -> None:
    x, a, b, pages, at, scales, out = _case(seed, pr=(4, 16, 12)[seed], fin=37 + 8 * seed)
    want = _torch(x, a, b, pages, at, scales, out)
    got = out.clone()
    lora_pairs_cpu(x, a, b, pages, at, scales, got, isa=isa)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, out)  # it did add


def test_no_pairs_changes_nothing_and_bad_inputs_are_refused() -> None:
    x, a, b, pages, at, scales, out = _case(3)
    got = out.clone()
    empty = torch.empty(0, dtype=torch.int64)
    lora_pairs_cpu(x, a, b, empty, empty, torch.empty(0), got)
    assert torch.equal(got, out)
    with pytest.raises(ValueError, match="outside"):
        lora_pairs_cpu(x, a, b, pages + a.shape[0], at, scales, got)
    with pytest.raises(ValueError, match="outside"):
        lora_pairs_cpu(x, a, b, pages, at + x.shape[0], scales, got)
    with pytest.raises(ValueError, match="float32"):
        lora_pairs_cpu(x.double(), a, b, pages, at, scales, got)
    with pytest.raises(ValueError, match="contiguous"):
        lora_pairs_cpu(x, a, b.transpose(1, 2).contiguous().transpose(1, 2), pages, at, scales, got)
