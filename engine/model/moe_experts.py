"""The routed experts of one MoE layer over the step's tokens: `experts_forward`, the seam a device kernel
replaces (a CUDA fused-MoE kernel slots in here), with each token's own adapter's LoRA on its experts.

For x [T, H], each token's top-k expert ids and routing weights, and the step's expert LoRA (or None)::

    key[t, j]  = ids[t, j] * (A + 1) + adapter(t)      A adapters with expert LoRA; A: none
    order      = argsort(key)  (stable, once)           pairs grouped by expert, then by adapter
    gu  = grouped GEMM: for each expert e with rows, gu[rows_e] = x[rows_e] @ W_gate_up[e].T
          then per (expert e, adapter a) run:  gu[run] += s_a (x[run] @ A_a,e.T) @ B_a,e.T
          (an adapter's runs in padded `bmm`s, `ExpertLoRAStep.add_runs`;
           runs of fewer than `SHORT_RUN` rows: all of them at once, pages gathered, two `bmm`s)
    h   = silu(gu[:, :I]) * gu[:, I:]
    y   = grouped GEMM with W_down, then per run  y[run] += s_a (h[run] @ A'_a,e.T) @ B'_a,e.T
    out[t] = sum_j weight[t, j] * y[pair (t, j)]        (`index_add_` in pair order)

Experts without tokens are never read, so a decode step's cost follows the active experts' weights. The
grouped GEMM on the CPU: the experts with at most `NATIVE_MAX_ROWS` rows run the native kernel
`kernels/moe_gemm_cpu.py`, which streams each active expert's weight once for all of its rows (a GEMM
library re-blocks the weight inside each small call, or on AMD CPUs MKL takes a slow path: 1.6-2.2x slower
at decode shapes on a 2-core Zen 4, docs/benchmarks.md), and experts with more rows a GEMM each; a step
where no expert is that small takes one `torch._grouped_mm` per projection over the sorted rows (0.84x
the time of a torch loop over the experts); elsewhere, or where this torch lacks it, that loop. A CPU
decode-sized step skips all of this: `fused_decode_applies` sends the whole block, routing included, to
one native call (`kernels/moe_fused_cpu.py`; the ~20 torch ops' dispatch cost more than the GEMMs at batch
1), with the layer's expert LoRA inside it (`fused_lora_applies`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

log = logging.getLogger(__name__)


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

    def add_runs(
        self,
        layer: int,
        proj: str,
        runs: Sequence[tuple[int, int, int, int]],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`add` for every run (expert, adapter, first row, rows) of x and out, in batched GEMMs."""
        ...

    def add_pairs(
        self,
        layer: int,
        proj: str,
        rows: list[int],
        experts: list[int],
        adapters: list[int],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`add` for single rows: row `rows[k]` of x and out with adapter `adapters[k]`, `experts[k]`."""
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
    `weights` [T, k] in x's dtype, `ids` [T, k] in 0..E, where E marks a pair whose expert is on another
    rank (expert parallel: dropped, this rank's output is a partial sum); `lora` the step's expert LoRA,
    `layer` its layer index."""
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
    counts = torch.bincount(flat, minlength=(num_experts + 1) * groups)[: num_experts * groups]
    per_expert = counts.view(num_experts, groups).sum(1)
    runs = counts.tolist()
    sizes = per_expert.tolist()
    order = order[: sum(sizes)]  # expert parallel: pairs of other ranks' experts (id E) sort last, dropped
    if not len(order):  # every pair is another rank's
        return torch.zeros_like(x)
    tokens = order // top_k
    xs = x[tokens]
    gu = _grouped_linear(xs, gate_up, sizes, per_expert)
    plan = _RunPlan(runs, groups) if lora is not None else None
    if lora is not None and plan is not None:
        plan.apply(lora, layer, "gate_up", xs, gu)
    h = nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    ys = _grouped_linear(h, down, sizes, per_expert)
    if lora is not None and plan is not None:
        plan.apply(lora, layer, "down", h, ys)
    ys.mul_(weights.reshape(-1)[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def _grouped_linear(
    xs: torch.Tensor, w: torch.Tensor, sizes: list[int], counts: torch.Tensor
) -> torch.Tensor:
    """`ys[rows of e] = xs[rows of e] @ w[e].T` for the expert-sorted rows `xs` (`sizes[e]` rows each).
    On the CPU the experts with at most `NATIVE_MAX_ROWS` rows run the native streaming kernel (where it
    builds) and any with more a GEMM each; when no expert is that small (or elsewhere), one
    `torch._grouped_mm` (where this torch has it), else a GEMM per expert with rows (module docstring)."""
    small = min((n for n in sizes if n), default=0) <= NATIVE_MAX_ROWS and w.is_contiguous()
    if small and _native_works(xs.device.type, xs.dtype):
        from kernels.moe_gemm_cpu import grouped_small_gemm

        ys = xs.new_empty(xs.shape[0], w.shape[1])
        grouped_small_gemm(xs, w, counts, NATIVE_MAX_ROWS, ys)  # skips the experts with more rows
        return _linear_per_expert(xs, w, sizes, ys, more_than=NATIVE_MAX_ROWS)
    if _grouped_mm_works(xs.device.type, xs.dtype):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
    return _linear_per_expert(xs, w, sizes, xs.new_empty(xs.shape[0], w.shape[1]))


def _linear_per_expert(
    xs: torch.Tensor, w: torch.Tensor, sizes: list[int], ys: torch.Tensor, more_than: int = 0
) -> torch.Tensor:
    """`ys[rows of e] = xs[rows of e] @ w[e].T`, one GEMM for each expert with more than `more_than`
    rows (the others' rows of `ys` are left as they are); returns `ys`."""
    start = 0
    for e, n in enumerate(sizes):
        if n > more_than:
            ys[start : start + n] = nn.functional.linear(xs[start : start + n], w[e])
        start += n
    return ys


# experts with at most this many rows of a step run the native kernel on the CPU (`_native_works`);
# measured on the benchmark's expert shape (Zen 4, one layer's gate_up): the kernel is ahead of torch's
# GEMMs up to 32 rows an expert at 1 and 2 threads in float32 and bfloat16, and behind in bfloat16 past 64
NATIVE_MAX_ROWS = 32


@functools.cache
def _native_works(device: str, dtype: torch.dtype) -> bool:
    """Whether the native small-GEMM kernel (`kernels/moe_gemm_cpu.py`) runs here for `dtype` and agrees
    with `F.linear` on a small case (float32 / bfloat16 on the CPU, where the library builds)."""
    if device != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    from kernels.moe_gemm_cpu import grouped_small_gemm
    from kernels.native_build import NativeBuildError

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 40, generator=gen).to(dtype), torch.randn(3, 24, 40, generator=gen).to(dtype)
    y = a.new_empty(5, 24)
    try:
        grouped_small_gemm(a, b, torch.tensor([2, 0, 3]), NATIVE_MAX_ROWS, y)
    except NativeBuildError as exc:
        log.warning("native MoE GEMM unavailable, using torch's: %s", exc)
        return False
    ref = torch.cat([nn.functional.linear(a[:2], b[0]), nn.functional.linear(a[2:], b[2])])
    return bool(torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2))


# CPU steps run routing and experts as one native call (`fused_decode_applies`) while they are
# decode-sized: at most FUSED_MAX_TOKENS tokens, or (token, expert) pairs averaging at most
# FUSED_ROWS_PER_EXPERT rows per expert (a batch-32 decode of a top-4-of-32 model is ~4 rows an expert: the
# streaming kernel's shape). Measured on the benchmark's model (Zen 4, 1 and 2 threads, with the blocks
# reading one weight row at a time): the call is 0.5-0.8x op by op's time at 12-16 rows an expert, even
# at 24 (0.77-0.99x), and behind at 32 at 1 thread (1.07x).
# FUSED_DECODE = False: the op-by-op path above (bench/offline/moe.py's leg).
FUSED_DECODE = True
FUSED_MAX_TOKENS = 16
FUSED_ROWS_PER_EXPERT = 16
# False: a layer with expert LoRA leaves the fused call for the op-by-op path (bench and tests compare)
FUSED_LORA = True


def fused_decode_applies(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    lora: ExpertLoRAHook | None,
    layer: int,
    top_k: int,
) -> bool:
    """Whether the routed block over `x` runs `kernels/moe_fused_cpu.py`'s one call: on the CPU, a
    decode-sized step (1 to `FUSED_MAX_TOKENS` tokens, or `tokens * top_k` pairs averaging at most
    `FUSED_ROWS_PER_EXPERT` rows over the layer's experts), float32 / bfloat16 where it builds, contiguous
    weights, and no expert LoRA in `layer` or LoRA the call takes (`fused_lora_applies`)."""
    tokens = x.shape[0]
    decode = tokens <= FUSED_MAX_TOKENS or tokens * top_k <= FUSED_ROWS_PER_EXPERT * gate_up.shape[0]
    if not FUSED_DECODE or x.device.type != "cpu" or not (tokens > 0 and decode):
        return False
    if x.stride(1) != 1 or not (gate_up.is_contiguous() and down.is_contiguous()):
        return False
    if lora is not None and lora.adapts(layer) and not fused_lora_applies(x, lora):
        return False
    return _fused_works(x.dtype)


def fused_lora_applies(x: torch.Tensor, lora: ExpertLoRAHook) -> bool:
    """Whether the fused call takes the step's expert LoRA `lora` over `x`: pages of x's dtype
    (`ExpertLoRAStep.page_dtype`), a hook that gives the kernel's view of its pages (`kernel_lora`), and
    `FUSED_LORA`."""
    same = getattr(lora, "page_dtype", None) == x.dtype
    return FUSED_LORA and same and hasattr(lora, "kernel_lora")


@functools.cache
def _fused_works(dtype: torch.dtype) -> bool:
    """Whether the fused decode kernel builds here for `dtype` (float32 / bfloat16) and agrees with the
    op-by-op path on a small case."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    from kernels.moe_fused_cpu import fused_moe_cpu
    from kernels.native_build import NativeBuildError

    gen = torch.Generator().manual_seed(0)
    x, router = torch.randn(3, 40, generator=gen).to(dtype), torch.randn(6, 40, generator=gen).to(dtype)
    gate_up, down = (
        torch.randn(6, 16, 40, generator=gen).to(dtype),
        torch.randn(6, 40, 8, generator=gen).to(dtype),
    )
    try:
        got = fused_moe_cpu(x, router, gate_up, down, 2, True)
    except NativeBuildError as exc:
        log.warning("native fused MoE unavailable, using the op-by-op path: %s", exc)
        return False
    probs = torch.softmax(nn.functional.linear(x, router).float(), dim=-1)
    weights, ids = torch.topk(probs, 2, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)
    ref = experts_forward(gate_up, down, x, weights, ids)
    return bool(torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-1))


@functools.cache
def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` exists here and computes the per-expert GEMMs exactly (CPU only: on
    CUDA it needs Hopper-class GPUs and aligned shapes, and a fused-MoE kernel is the fast path there)."""
    if device != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 8, generator=gen).to(dtype), torch.randn(3, 16, 8, generator=gen).to(dtype)
    try:
        y = torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([2, 2, 5], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref = torch.cat([nn.functional.linear(a[:2], b[0]), nn.functional.linear(a[2:], b[2])])
    return bool(torch.allclose(y.float(), ref.float(), rtol=1e-3, atol=1e-3))


# (expert, adapter) runs shorter than this (decode rows) are applied together as gathered pairs, while
# they are at most GATHER_MAX_PAIRS rows in all (the gathered pages are a copy of K pages); longer runs,
# and all runs of a step with more such rows (a prefill over many adapters), multiply the pages in place
SHORT_RUN = 4
GATHER_MAX_PAIRS = 128


class _RunPlan:
    """A layer's (expert, adapter) runs over the sorted rows: `runs[e * groups + j]` rows of adapter j
    within expert e's rows, in that order (j = groups - 1: rows without expert LoRA, never touched)."""

    def __init__(self, runs: list[int], groups: int) -> None:
        self.long: list[tuple[int, int, int, int]] = []  # (expert, adapter, first row, rows)
        self.rows: list[int] = []  # rows of short runs, with their expert and adapter
        self.experts: list[int] = []
        self.adapters: list[int] = []
        lo, short = 0, list[tuple[int, int, int, int]]()
        for i, n in enumerate(runs):
            e, j = divmod(i, groups)
            if n and j < groups - 1:
                (self.long if n >= SHORT_RUN else short).append((e, j, lo, n))
            lo += n
        if sum(n for *_, n in short) > GATHER_MAX_PAIRS:
            self.long += short
            return
        for e, j, lo, n in short:
            self.rows.extend(range(lo, lo + n))
            self.experts.extend([e] * n)
            self.adapters.extend([j] * n)

    def apply(self, lora: ExpertLoRAHook, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Every run's LoRA delta for projection `proj` into `out` (rows of x and out: the sorted pairs)."""
        if self.long:
            lora.add_runs(layer, proj, self.long, x, out)
        if self.rows:
            lora.add_pairs(layer, proj, self.rows, self.experts, self.adapters, x, out)
