"""Per-request logits processing for a batch of rows, before the sampler picks: vectorized over the rows.

In vLLM's order, on the rows whose `SamplingParams` ask for it (other rows are not touched, and a step
where no row asks costs nothing but a scan of the params):

1. bad words: a banned sequence's last token is set to -inf when the output ends with the rest of it
   (a one-token sequence is always banned);
2. `min_tokens`: EOS and `stop_token_ids` are set to -inf while the output is shorter;
3. `logit_bias`: added to the logits of its tokens;
4. penalties, in one sparse pass over the penalized rows (one `unique` with counts over all their
   tokens; only the logits of tokens seen change): repetition (vLLM/HF: a token seen in prompt or
   output has its logit divided by p when positive, multiplied by p when negative), then frequency and
   presence (OpenAI: minus `frequency × count` and `presence × [count > 0]`, counts over the output).

`apply_min_p` is applied by the sampler after temperature (vLLM's order: then top-k/top-p). A row that
processing would leave with no allowed token keeps its unprocessed logits (e.g. a grammar that allows only
EOS under `min_tokens`), so sampling never sees an empty distribution.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams


class History(Protocol):
    """What processing reads of the sequence a logits row belongs to (`engine.sequence.Sequence` is one)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class DraftHistory:
    """A verification row's history: the sequence's tokens plus the proposed tokens before that row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def process_logits(
    logits: torch.Tensor, seqs: Seq[History], eos_token_ids: Seq[int] = (), in_place: bool = False
) -> torch.Tensor:
    """logits [S, V] float32, row i for `seqs[i]` -> the processed logits: `logits` itself when no row
    is processed or `in_place`, else a new tensor. Row i sees the tokens `seqs[i]` holds (its next
    token is row i's)."""
    params = [s.params for s in seqs]
    touched = [
        i
        for i, p in enumerate(params)
        if p.penalized or p.logit_bias or p.min_tokens or p.bad_words_token_ids
    ]
    if not touched:
        return logits
    out = logits if in_place and logits.is_contiguous() else logits.clone()
    touched_idx = _idx(touched, out)
    before = out.index_select(0, touched_idx)
    vocab = out.shape[1]
    banned_rows: list[int] = []
    banned_toks: list[int] = []
    for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
        for tok in _banned(s, p, eos_token_ids):
            if 0 <= tok < vocab:
                banned_rows.append(i)
                banned_toks.append(tok)
    if banned_rows:
        out[_idx(banned_rows, out), _idx(banned_toks, out)] = float("-inf")
    bias_rows, bias_toks, bias_vals = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            for tok, value in p.logit_bias.items():
                if tok < vocab:
                    bias_rows.append(i)
                    bias_toks.append(tok)
                    bias_vals.append(float(value))
    if bias_rows:
        values = torch.tensor(bias_vals, dtype=out.dtype, device=out.device)
        out.index_put_((_idx(bias_rows, out), _idx(bias_toks, out)), values, accumulate=True)
    rows = [i for i, p in enumerate(params) if p.penalized]
    if rows:
        _apply_penalties(out, rows, [seqs[i] for i in rows])
    empty = torch.isneginf(out.index_select(0, touched_idx)).all(dim=1)
    if bool(empty.any()):  # nothing left: keep that row's logits as they were
        out[touched_idx[empty]] = before[empty]
    return out


def _banned(seq: History, p: SamplingParams, eos_token_ids: Seq[int]) -> list[int]:
    """Tokens row `seq` may not take next: bad-word endings and, under `min_tokens`, EOS and stop ids."""
    out: list[int] = []
    produced = seq.output_token_ids
    for word in p.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(produced):
            continue
        if prefix == 0 or produced[-prefix:] == word[:-1]:
            out.append(word[-1])
    if len(produced) < p.min_tokens:
        if not p.ignore_eos:
            out.extend(eos_token_ids)
        out.extend(p.stop_token_ids)
    return out


def _apply_penalties(out: torch.Tensor, rows: list[int], seqs: list[History]) -> None:
    """Repetition, then frequency and presence penalties on rows `rows` of `out`, in place, in one pass.

    Sparse over the batch: each (row, token) pair the rows' histories contain is found once (one
    `unique` over flat `row * V + token` keys, with counts), and only those logits are read and written,
    so the cost grows with the tokens seen, not with rows × vocabulary."""
    dev, vocab = out.device, out.shape[1]
    flat = out.view(-1)
    out_keys: list[int] = []
    seen_keys: list[int] = []
    for r, s in zip(rows, seqs, strict=True):
        base = r * vocab
        out_keys.extend(base + t for t in s.output_token_ids)
        if s.params.repetition_penalty != 1.0:
            seen_keys.extend(base + t for t in s.prompt_token_ids)
    rep_of = torch.ones(out.shape[0], dtype=out.dtype, device=dev)
    freq_of = torch.zeros(out.shape[0], dtype=out.dtype, device=dev)
    pres_of = torch.zeros(out.shape[0], dtype=out.dtype, device=dev)
    index = _idx(rows, out)
    rep_of[index] = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=out.dtype, device=dev)
    freq_of[index] = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=out.dtype, device=dev)
    pres_of[index] = torch.tensor([s.params.presence_penalty for s in seqs], dtype=out.dtype, device=dev)
    keys = torch.tensor(out_keys, dtype=torch.long, device=dev)
    uniq, counts = torch.unique(keys, return_counts=True)
    if any(s.params.repetition_penalty != 1.0 for s in seqs):
        seen = torch.unique(torch.cat([uniq, torch.tensor(seen_keys, dtype=torch.long, device=dev)]))
        rep = rep_of[seen // vocab]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if uniq.numel():
        row = uniq // vocab
        flat[uniq] -= freq_of[row] * counts.to(out.dtype) + pres_of[row]


def apply_min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """scaled [S, V] tempered logits -> -inf where p(token) < min_p[row] × max p (rows with 0: unchanged;
    the most likely token is always kept)."""
    threshold = torch.tensor(min_p, dtype=scaled.dtype, device=scaled.device)[:, None]
    probs = scaled.softmax(dim=-1)
    drop = probs < threshold * probs.max(dim=-1, keepdim=True).values
    return scaled.masked_fill(drop, float("-inf"))


def _idx(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
