"""Accept or reject proposed tokens against the target model's distributions (one call per step).

A sequence with proposed tokens d_1..d_k has k+1 logits rows: row i is the target's next-token
distribution p_i after the accepted prefix and d_1..d_i (row 0: after the real tokens only).

- Greedy: accept the longest prefix with d_{i+1} == argmax p_i, then emit argmax p_a at the first
  mismatch a (or the bonus argmax p_k when all k were accepted): exactly the greedy tokens.
- Sampling (the proposals are point masses, as n-gram and greedy draft proposals are): row i samples
  s_i = argmax(p_i / q_i), with q_i the Exp(1) noise of its output position (`engine/sampling_noise.py`:
  a function of (seed, position) for a seeded request, fresh random noise per row otherwise). Accept the
  longest prefix with d_{i+1} == s_i, then emit s_a at the first mismatch a (or the bonus s_k).
  Exactness: the noise of different rows is independent, so given the emitted prefix (which fixes the
  context of row a) s_a is a draw from p_a whatever happened at rows < a; each emitted token is therefore
  distributed exactly as under p (temperature, min_p, top-k, top-p applied). It is the rejection rule
  for a point-mass draft q = delta(d): accept with probability p_i(d) = P(s_i = d), and on rejection
  s_i is distributed as normalize(max(0, p_i - q)). A seeded request emits, moreover, the very tokens
  it emits without speculation, whatever k was: position t's token is the sampler's token for (seed, t)
  given the same prefix, so tests and users can compare engines, loads and k freely. Unseeded rows use
  the same rule with the engine generator's noise (one `exponential_` over the verified rows).
Log-probabilities are reported under the raw (untempered) distribution, as the sampler does.

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
from engine.sampling_noise import sample_rows
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
    """Position-noise acceptance (module docstring) for sequences `which`, all at once (one host sync).

    probs [R, V]: the target's processed probabilities, rows of sequence i at starts[i]:starts[i+1].
    Row j of a sequence is its output position `num_output_tokens + j`; it samples with that position's
    noise (`engine/sampling_noise.py`) and accepts d_{j+1} iff the sample is d_{j+1}.
    """
    dev = probs.device
    rows = torch.tensor([r for i in which for r in range(starts[i], starts[i + 1])], device=dev)
    seeds: list[int | None] = []
    positions: list[int] = []
    for i in which:
        n = len(drafts[i]) + 1
        seeds += [seqs[i].params.seed] * n
        positions += range(seqs[i].num_output_tokens, seqs[i].num_output_tokens + n)
    picks = sample_rows(probs.index_select(0, rows), seeds, positions, generator).tolist()
    out = []
    lo = 0
    for i in which:
        n = len(drafts[i]) + 1
        a = 0
        while a < n - 1 and picks[lo + a] == drafts[i][a]:
            a += 1
        out.append(drafts[i][:a] + [picks[lo + a]])
        lo += n
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
