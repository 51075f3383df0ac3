"""Accept or reject proposed tokens against the target model's distributions (one call per step).

A sequence with proposed tokens d_1..d_k has k+1 logits rows: row i is the target's next-token
distribution p_i after the accepted prefix and d_1..d_i (row 0: after the real tokens only).

- Greedy: accept the longest prefix with d_{i+1} == argmax p_i, then emit argmax p_a at the first
  mismatch a (or the bonus argmax p_k when all k were accepted): exactly the greedy tokens.
- Sampling (rejection sampling with a point-mass draft q_i = delta(d_{i+1}), as n-gram and greedy
  draft proposals are): accept d_{i+1} with probability p_i(d_{i+1}); at the first rejection draw from
  normalize(max(0, p_i - q_i)) = p_i with d_{i+1} removed; after k acceptances draw the bonus from p_k.
  Every emitted token is then distributed exactly as under p (temperature, top-k, top-p applied to p).
A request with a `seed` draws its uniforms and its sample from its own generator. Log-probabilities are
reported under the raw (untempered) distribution, as the sampler does.
"""

from __future__ import annotations

import torch

from engine.outputs import Logprob
from engine.sampler import _filter_top_k_top_p
from engine.scheduler.output import SampledToken
from engine.sequence import Sequence


def verify(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    generator: torch.Generator,
) -> list[list[SampledToken]]:
    """logits [sum(len(d) + 1), V] float32, rows of each sequence contiguous -> tokens it emits (1..k+1)."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    argmax = logits.argmax(dim=-1).tolist()
    probs = _target_probs(logits, seqs, drafts)
    out: list[list[SampledToken]] = []
    for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
        lo = starts[i]
        if seq.params.greedy:
            tokens = _accept_greedy(argmax[lo : starts[i + 1]], draft)
        else:
            gen = seq.generator if seq.generator is not None else generator
            tokens = _accept_sampled(probs[lo : starts[i + 1]], draft, gen)
        out.append([SampledToken(t) for t in tokens])
    _add_logprobs(logits, seqs, starts, out)
    return out


def _accept_greedy(target: list[int], draft: list[int]) -> list[int]:
    """Accepted draft prefix (matching the target's argmax) plus the target's next token."""
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return draft[:a] + [target[a]]


def _accept_sampled(p: torch.Tensor, draft: list[int], gen: torch.Generator) -> list[int]:
    """Rejection sampling (see the module docstring); p [k+1, V] the target's processed probabilities."""
    k = len(draft)
    idx = torch.tensor(draft, dtype=torch.int64, device=p.device)
    p_draft = p[:k].gather(1, idx[:, None]).squeeze(1) if k else p.new_empty(0)
    u = torch.rand(k, generator=gen, device=p.device)
    rejected = (u >= p_draft).tolist()
    a = rejected.index(True) if True in rejected else k
    row = p[a].clone()
    if a < k:
        row[draft[a]] = 0.0  # normalize(max(0, p - delta(d))): p without the rejected token
    q = torch.empty_like(row).exponential_(generator=gen)
    return draft[:a] + [int((row / q).argmax())]


def _target_probs(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
    """Per row: softmax(filter_top_k_top_p(logits / temperature)) for sampling rows (greedy rows: 0)."""
    rows = [(s.params, len(d) + 1) for s, d in zip(seqs, drafts, strict=True)]
    if all(p.greedy for p, _ in rows):
        return logits.new_zeros(0)
    temps, top_k, top_p = [], [], []
    for p, n in rows:
        temps += [p.temperature if not p.greedy else 1.0] * n
        top_k += [p.top_k] * n
        top_p += [p.top_p] * n
    scaled = logits / torch.tensor(temps, device=logits.device)[:, None]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def _add_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], starts: list[int], out: list[list[SampledToken]]
) -> None:
    """Fill `logprob` / `top_logprobs` of the emitted tokens of sequences that asked for logprobs."""
    for i, seq in enumerate(seqs):
        k = seq.params.logprobs
        if k is None:
            continue
        toks = out[i]
        rows = logits[starts[i] : starts[i] + len(toks)]
        logp = torch.log_softmax(rows, dim=-1)
        chosen = torch.tensor([t.token_id for t in toks], device=logits.device)
        chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1)
        ranks = ((logp > chosen_lp[:, None]).sum(-1) + 1).tolist()
        top = logp.topk(k, dim=-1) if k else None
        for j, tok in enumerate(toks):
            lp = float(chosen_lp[j])
            entry = {tok.token_id: Logprob(lp, ranks[j])}
            if top is not None:
                for r, (tid, tlp) in enumerate(
                    zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True)
                ):
                    entry.setdefault(tid, Logprob(tlp, r + 1))
            tok.logprob = lp
            tok.top_logprobs = entry
