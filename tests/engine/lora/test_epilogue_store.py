"""The pool's DoRA / lora_bias epilogue store: slots grow past the capacity keeping stored vectors, evicted
slots return to the identity, and a step's epilogue touches only its adapters' rows."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.lora.epilogue import EpilogueStore, RowEpilogue


def _vectors(gen: torch.Generator, widths: list[int], mods: list[int]) -> dict[int, torch.Tensor]:
    return {m: torch.randn(2, 2, widths[m], generator=gen) for m in mods}


def test_slots_grow_and_evicted_slots_are_identity_again() -> None:
    gen = torch.Generator().manual_seed(0)
    widths = [6, 3, 5]
    store = EpilogueStore(2, widths, torch.device("cpu"))
    stored = [_vectors(gen, widths, [0, 2] if i % 2 else [1]) for i in range(9)]
    slots = [store.add(v) for v in stored]
    assert sorted(slots) == list(range(9)) and store.capacity == 16
    for slot, vecs in zip(slots, stored, strict=True):
        for m, t in enumerate(store.vec):
            assert t is not None
            want = vecs.get(m)
            if want is None:  # a module the adapter does not target: f = 1, c = 0
                assert torch.equal(t[:, 0, slot], torch.ones(2, widths[m])) and not t[:, 1, slot].any()
            else:
                assert torch.equal(t[:, :, slot], want)
    store.remove(slots[3])
    assert all(
        torch.equal(t[:, 0, slots[3]], torch.ones(2, w)) for t, w in zip(store.vec, widths, strict=True)
    )
    again = store.add(stored[3])
    assert again not in slots[:3] + slots[4:] and torch.equal(store.vec[0][:, :, again], stored[3][0])


def test_step_epilogue_updates_only_its_rows() -> None:
    """Rows of two epilogue adapters (one in a short run and a long one) get y*f + c of their own slot;
    others stay."""
    gen = torch.Generator().manual_seed(1)
    widths = [4, 3]
    store = EpilogueStore(1, widths, torch.device("cpu"))
    va, vb0, vb1 = (torch.randn(1, 2, w, generator=gen) for w in (4, 4, 3))
    a = SimpleNamespace(epi_slot=store.add({0: va}), epi_modules=frozenset({0}), layer_ranks=[[4, 0]])
    b = SimpleNamespace(epi_slot=store.add({0: vb0, 1: vb1}), epi_modules=frozenset({0, 1}))
    b.layer_ranks = [[4, 4]]
    y = torch.randn(12, 7, generator=gen)
    want = y.clone()
    epi = RowEpilogue(store, [(a, range(0, 2)), (b, range(3, 4)), (a, range(5, 12))])
    epi.apply(0, range(0, 2), y)
    f, c = store.vec[0][0, :, a.epi_slot]
    for r in (0, 1, *range(5, 12)):
        want[r, :4] = want[r, :4] * f + c
    f, c = store.vec[0][0, :, b.epi_slot]
    want[3, :4] = want[3, :4] * f + c
    f, c = store.vec[1][0, :, b.epi_slot]
    want[3, 4:] = want[3, 4:] * f + c
    torch.testing.assert_close(y, want)
