"""The routed experts of one MoE layer over the step's tokens: `experts_forward`, the seam a device kernel
replaces (a CUDA fused-MoE kernel slots in here), with each token's own adapter's LoRA on its experts.

For x [T, H], each token's top-k expert ids and routing weights, and the step's expert LoRA (or None)::

    key[t, j]  = ids[t, j] * (A + 1) + adapter(t)      A adapters with expert LoRA; A: none
    order      = argsort(key)  (stable, once)           pairs grouped by expert, then by adapter
    for each expert e with pairs (rows R_e of x[tokens[order]], base GEMM over all of them):
        gu        = x_e @ W_gate_up[e].T ;  gu[run_a] += s_a (x[run_a] @ A_a,e.T) @ B_a,e.T   per adapter run
        h         = silu(gu[:, :I]) * gu[:, I:]
        y_e       = h @ W_down[e].T      ;  y_e[run_a] += s_a (h[run_a] @ A'_a,e.T) @ B'_a,e.T
    out[t] = sum_j weight[t, j] * y[pair (t, j)]        (`index_add_` in pair order)

Experts without tokens are never read, so a decode step's cost follows the active experts' weights. The
base GEMMs run one per expert with tokens (on the CPU a torch loop; `torch._grouped_mm` over the sorted
rows measured no faster on a 2-core EPYC at decode and prefill shapes, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ExpertLoRAHook(Protocol):
    """A step's LoRA on the experts (`engine/lora/expert_step.py`, `ExpertLoRAStep`)."""

    num_adapters: int

    def row_adapter(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """int64 [num_rows]: each row's adapter index, `num_adapters` for rows without expert LoRA."""
        ...

    def adapts(self, layer: int) -> bool:
        """Whether any adapter of the step has expert LoRA in `layer`."""
        ...

    def add(
        self, layer: int, proj: str, expert: int, adapter: int, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """`out += scaling * (x @ A.T) @ B.T` of adapter `adapter` for `expert`'s projection `proj`."""
        ...


def experts_forward(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: ExpertLoRAHook | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """The routed experts' weighted output [T, H] (module docstring). `gate_up` [E, 2I, H], `down` [E, H, I],
    `weights` [T, k] in x's dtype, `ids` [T, k]; `lora` the step's expert LoRA, `layer` its layer index."""
    num_experts, top_k, inter = gate_up.shape[0], ids.shape[1], down.shape[2]
    groups = 1
    flat = ids.reshape(-1)
    if lora is not None and lora.adapts(layer):
        groups = lora.num_adapters + 1
        adapter = lora.row_adapter(x.shape[0], x.device)
        flat = flat * groups + adapter.repeat_interleave(top_k)
    else:
        lora = None
    order = torch.argsort(flat, stable=True)  # pairs sorted by (expert, adapter), once
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=num_experts * groups).tolist()
    xs = x[tokens]
    ys = torch.empty_like(xs)
    start = 0
    for e in range(num_experts):
        runs = counts[e * groups : (e + 1) * groups]
        n = sum(runs)
        if n == 0:
            continue
        end = start + n
        seg = xs[start:end]
        gu = nn.functional.linear(seg, gate_up[e])
        if lora is not None:
            _add_runs(lora, layer, "gate_up", e, runs, seg, gu)
        h = nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        ys[start:end] = nn.functional.linear(h, down[e])
        if lora is not None:
            _add_runs(lora, layer, "down", e, runs, h, ys[start:end])
        start = end
    ys.mul_(weights.reshape(-1)[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def _add_runs(
    lora: ExpertLoRAHook,
    layer: int,
    proj: str,
    expert: int,
    runs: list[int],
    x: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Each adapter run's LoRA delta for `expert` into `out` (the last run, rows without one, untouched)."""
    lo = 0
    for j, n in enumerate(runs[:-1]):
        if n:
            lora.add(layer, proj, expert, j, x[lo : lo + n], out[lo : lo + n])
        lo += n
