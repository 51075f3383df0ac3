"""`verify` on fixed logits with seeded rows (engine/sampling_noise.py): it emits exactly the sampler's tokens
for those positions, and the emitted tokens follow p (goodness of fit over many seeds on a tiny vocabulary).

Breaking the rule fails these: noise shared by every position makes the second token repeat the first
(the fit of the second token fails); noise indexed by the row within the step instead of the output
position, or drawn from a generator, makes the tokens differ from the sampler's.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec.verify import verify
from tests.engine.test_speculative_sampling import goodness_of_fit

CPU = torch.device("cpu")


def _seq(seed: int, params: SamplingParams, num_output: int) -> Sequence:
    """A sequence of `params` seeded `seed`, with `num_output` tokens generated."""
    seeded = msgspec.structs.replace(params, seed=seed)
    seq = Sequence(f"s{seed}", [1, 2], seeded, 0.0, max_total_tokens=99)
    for t in range(num_output):
        seq.append_token(3 + t % 2)
    return seq


def test_verify_emits_the_samplers_tokens():
    """Three rows, context-free logits: row j is position t0 + j. The sampler's token at each position
    (one call per position, as without speculation) decides what verification accepts and emits."""
    torch.manual_seed(3)
    logits = torch.randn(3, 7) * 1.3
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.95, max_tokens=50)
    sampler = Sampler(CPU, seed=123)
    lengths = Counter()
    for seed in range(300):
        t0 = seed % 4
        want = [
            sampler(logits[j : j + 1].clone(), [_seq(seed, params, t0 + j)])[0].token_id for j in range(3)
        ]
        # proposals: the sampler's tokens, one of them replaced on a third of the seeds
        draft = want[:2]
        if seed % 3 == 1:
            draft = [(want[0] + 1) % 7, want[1]]
        elif seed % 3 == 2:
            draft = [want[0], (want[1] + 1) % 7]
        a = 0
        while a < 2 and draft[a] == want[a]:
            a += 1
        out = verify(logits.clone(), [_seq(seed, params, t0)], [draft], sampler.generator)[0]
        assert [t.token_id for t in out] == want[: a + 1], seed
        lengths[len(out)] += 1
    assert set(lengths) == {1, 2, 3}


def test_seeded_verification_follows_p():
    """Rows 0 and 1 share one distribution (so noise reused across positions would show), row 2 another;
    one sequence per seed, all in one batch; the first emitted token, and the second after d_1 was
    accepted, both follow p."""
    torch.manual_seed(0)
    row = torch.randn(5) * 1.2
    logits = torch.stack([row, row, torch.randn(5)])
    params = SamplingParams(temperature=1.0, max_tokens=50)
    p = logits.softmax(-1)
    d1 = int(p[0].argmax())
    d2 = int(p[1].argsort(descending=True)[1])
    n = 8000
    seqs = [_seq(seed, params, seed % 5) for seed in range(n)]
    gen = torch.Generator().manual_seed(0)
    out = verify(logits.repeat(n, 1), seqs, [[d1, d2]] * n, gen)
    first, second = Counter(), Counter()
    for toks in out:
        ids = [t.token_id for t in toks]
        first[ids[0]] += 1
        if ids[0] == d1:
            second[ids[1]] += 1
    assert abs(first[d1] / n - float(p[0, d1])) < 0.02
    assert goodness_of_fit(first, p[0]) > 1e-3
    assert goodness_of_fit(second, p[1]) > 1e-3
