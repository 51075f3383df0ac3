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

p_i is the distribution the sampler would draw from at that position: each row's logits are processed
first (`engine/logits_processing.py`: penalties, `logit_bias`, `min_tokens`, bad words) with the row's
own history, the real tokens plus d_1..d_i, and `min_p` applies after temperature; so processed requests
speculate and stay exact.
"""

from __future__ import annotations

import torch

from engine.logits_processing import DraftHistory, apply_min_p, process_logits
from engine.outputs import Logprob
from engine.sampler import _filter_top_k_top_p
from engine.scheduler.output import SampledToken
from engine.sequence import Sequence


def verify(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    generator: torch.Generator,
    eos_token_ids: tuple[int, ...] = (),
) -> list[list[SampledToken]]:
    """logits [sum(len(d) + 1), V] float32, rows of each sequence contiguous -> tokens it emits (1..k+1).
    `eos_token_ids`: masked under `min_tokens`, as the sampler does."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    raw = logits
    logits = _processed(logits, seqs, drafts, eos_token_ids)
    argmax = logits.argmax(dim=-1).tolist()
    emitted: list[list[int]] = [[] for _ in seqs]
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        probs = _target_probs(logits, seqs, drafts)
        for i, tokens in zip(
            sampled, _accept_sampled(probs, starts, seqs, drafts, sampled, generator), strict=True
        ):
            emitted[i] = tokens
    out: list[list[SampledToken]] = []
    for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
        tokens = (
            emitted[i] if not seq.params.greedy else _accept_greedy(argmax[starts[i] : starts[i + 1]], draft)
        )
        out.append([SampledToken(t) for t in tokens])
    _add_logprobs(raw, seqs, starts, out)
    return out


def _processed(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], eos_token_ids: tuple[int, ...]
) -> torch.Tensor:
    """Each row's logits processed with its own history (the sequence's tokens + the proposals before
    that row); `logits` itself when no sequence asks for processing."""
    if not any(s.params.processes_logits for s in seqs):
        return logits
    rows = [
        DraftHistory(s.params, s.prompt_token_ids, s.output_token_ids + d[:j])
        for s, d in zip(seqs, drafts, strict=True)
        for j in range(len(d) + 1)
    ]
    return process_logits(logits, rows, eos_token_ids)


def _accept_greedy(target: list[int], draft: list[int]) -> list[int]:
    """Accepted draft prefix (matching the target's argmax) plus the target's next token."""
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return draft[:a] + [target[a]]


def _accept_sampled(
    probs: torch.Tensor,
    starts: list[int],
    seqs: list[Sequence],
    drafts: list[list[int]],
    which: list[int],
    generator: torch.Generator,
) -> list[list[int]]:
    """Rejection sampling (module docstring) for sequences `which`, all at once (two host syncs).

    probs [R, V]: the target's processed probabilities, rows of sequence i at starts[i]:starts[i+1].
    Row j of a sequence verifies its proposal d_{j+1} (the last row has none: the bonus token). A seeded
    sequence draws its uniforms and its sample's noise from its own generator, in that order.
    """
    dev = probs.device
    rows = torch.tensor([r for i in which for r in range(starts[i], starts[i + 1])], device=dev)
    p = probs.index_select(0, rows)  # [R', V]
    proposal = [t for i in which for t in [*drafts[i], -1]]  # -1: the bonus row proposes nothing
    prop = torch.tensor(proposal, dtype=torch.int64, device=dev)
    p_prop = p.gather(1, prop.clamp(min=0)[:, None]).squeeze(1).masked_fill(prop < 0, 0.0)
    u = torch.empty(len(proposal), device=dev)
    q = torch.empty(len(which), p.shape[1], device=dev)
    u.uniform_(generator=generator)
    q.exponential_(generator=generator)
    lo = 0
    for j, i in enumerate(which):
        n = len(drafts[i]) + 1
        gen = seqs[i].generator
        if gen is not None:  # reproducible whatever else is in the batch
            u[lo : lo + n].uniform_(generator=gen)
            q[j].exponential_(generator=gen)
        lo += n
    accept = (u < p_prop).tolist()  # bonus rows: never (p_prop = 0)
    final_rows, rejected = [], []
    lo = 0
    for i in which:
        n = len(drafts[i]) + 1
        a = accept[lo : lo + n].index(False)
        final_rows.append(lo + a)
        rejected.append(drafts[i][a] if a < n - 1 else -1)
        lo += n
    target = p.index_select(0, torch.tensor(final_rows, device=dev))
    rej = torch.tensor(rejected, dtype=torch.int64, device=dev)
    # normalize(max(0, p - delta(d))): p without the rejected proposal (nothing removed for a bonus row)
    keep = torch.ones_like(target).scatter_(1, rej.clamp(min=0)[:, None], 0.0)
    keep[rej < 0] = 1.0
    picks = ((target * keep) / q).argmax(dim=-1).tolist()
    out = []
    lo = 0
    for j, i in enumerate(which):
        a = final_rows[j] - lo
        out.append(drafts[i][:a] + [picks[j]])
        lo += len(drafts[i]) + 1
    return out


def _target_probs(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
    """Per row: softmax(top-k/top-p(min_p(logits / temperature))) for sampling rows, as the sampler
    draws (greedy rows: 0)."""
    rows = [(s.params, len(d) + 1) for s, d in zip(seqs, drafts, strict=True)]
    if all(p.greedy for p, _ in rows):
        return logits.new_zeros(0)
    temps, top_k, top_p, min_p = [], [], [], []
    for p, n in rows:
        temps += [p.temperature if not p.greedy else 1.0] * n
        top_k += [p.top_k] * n
        top_p += [p.top_p] * n
        min_p += [p.min_p if not p.greedy else 0.0] * n
    scaled = logits / torch.tensor(temps, device=logits.device)[:, None]
    if any(m > 0.0 for m in min_p):
        scaled = apply_min_p(scaled, min_p)
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
