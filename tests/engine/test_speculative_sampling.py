"""Rejection sampling keeps the target distribution exactly.

1. `verify` alone, on fixed logits: the first emitted token follows p_0, and the second (given that the
   first proposal was accepted) follows p_1, under temperature and top-k; goodness-of-fit chi-square.
2. End to end on the demo model at temperature 2 (flat enough that proposals are often rejected): the
   distribution of generated tokens 2 and 3 with speculation equals the one without (two-sample
   chi-square over thousands of sequences, fixed seeds).
A rule that accepts too often, or that resamples from p instead of p minus the proposal after a
rejection, moves tens of percent of mass and fails these tests by a wide margin.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from engine.spec.verify import verify

DEMO = Path(__file__).resolve().parents[2] / "demo"


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def goodness_of_fit(counts: Counter, probs: torch.Tensor) -> float:
    """p-value of observed token counts against expected probabilities (tokens with p > 0)."""
    n = sum(counts.values())
    support = [t for t in range(probs.shape[0]) if probs[t] > 0]
    assert all(t in support for t in counts), "a token outside the support was emitted"
    stat = sum((counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in support)
    return chi2_sf(stat, len(support) - 1)


def two_sample(a: Counter, b: Counter, min_count: int = 10) -> float:
    """p-value that two samples of categories come from one distribution (rare categories pooled)."""
    pooled = a + b
    cats = [c for c, k in pooled.items() if k >= min_count]
    other_a = sum(k for c, k in a.items() if c not in cats)
    other_b = sum(k for c, k in b.items() if c not in cats)
    rows = [(a.get(c, 0), b.get(c, 0)) for c in cats] + ([(other_a, other_b)] if other_a + other_b else [])
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return chi2_sf(stat, len(rows) - 1)


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits / temperature
    if top_k > 0:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(-1)


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, -1), (0.7, 3)])
def test_verify_preserves_the_target_distribution(temperature, top_k):
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    p = torch.stack([_target(row, temperature, top_k) for row in logits])
    # proposals: a likely token, then a less likely one (both accepted and rejected often)
    d1 = int(p[0].argsort(descending=True)[1])
    d2 = int(p[1].argmax())
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=8)
    gen = torch.Generator().manual_seed(1)
    first, second, lengths = Counter(), Counter(), Counter()
    batch = 2000
    for _ in range(6):
        seqs = [Sequence(f"s{i}", [1], params, 0.0) for i in range(batch)]
        out = verify(logits.repeat(batch, 1), seqs, [[d1, d2]] * batch, gen)
        for toks in out:
            ids = [t.token_id for t in toks]
            first[ids[0]] += 1
            lengths[len(ids)] += 1
            if ids[0] == d1:
                second[ids[1]] += 1
    assert lengths[1] and lengths[2] and lengths[3]  # rejections at both positions, and full acceptance
    assert first[d1] / sum(first.values()) == pytest.approx(float(p[0, d1]), abs=0.02)
    assert goodness_of_fit(first, p[0]) > 1e-3
    assert goodness_of_fit(second, p[1]) > 1e-3


def test_sampled_outputs_match_non_speculative_distribution():
    """Demo base model, prompt 'hello world=' (echoed): tokens 2 and 3 are produced by verification
    (proposals start after the first token) and must be distributed as without speculation."""
    kw = dict(device="cpu", dtype="float32", max_num_seqs=256, seed=0)
    params = SamplingParams(n=64, max_tokens=3, temperature=2.0, ignore_eos=True)
    prompts = ["hello world="] * 32  # 2048 sequences per engine
    samples = {}
    for spec in (None, "ngram"):
        llm = LLM(str(DEMO / "base"), speculative=spec, num_speculative_tokens=3, **kw)
        if llm.engine.spec is not None:
            llm.engine.spec.cost.fixed_theta = 0.05  # reproducible: independent of this machine's timings
        outs = llm.generate(prompts, params)
        samples[spec] = [tuple(c.token_ids) for o in outs for c in o.outputs]
        if spec:
            st = llm.engine.get_stats()
            assert st.spec_verifications > 1000
            assert 0 < st.spec_accepted_tokens < st.spec_proposed_tokens
    plain, spec_s = samples[None], samples["ngram"]
    for pos in (1, 2):
        pv = two_sample(Counter(s[pos] for s in plain), Counter(s[pos] for s in spec_s))
        assert pv > 1e-3, f"token {pos + 1}: p = {pv:.2e}"
    # the joint distribution of tokens 2-3 given the most common first token
    top = Counter(s[0] for s in plain).most_common(1)[0][0]
    pv = two_sample(
        Counter(s[1:] for s in plain if s[0] == top), Counter(s[1:] for s in spec_s if s[0] == top)
    )
    assert pv > 1e-3, f"tokens 2-3 given token 1: p = {pv:.2e}"
