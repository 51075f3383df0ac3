"""A decode step's whole routed-experts block on the CPU in one native call (``csrc/moe_fused_cpu.c``).

`fused_moe_cpu(x, router, gate_up, down, top_k, norm_topk_prob)` computes what `SparseMoE.route` followed by
`experts_forward` computes (engine/model/moe.py, engine/model/moe_experts.py) -- router GEMM, float32
softmax, top-k, renormalization where `norm_topk_prob`, the sort of the (token, expert) pairs by expert,
the gate_up GEMM, SiLU * up, the down GEMM and the weighted combine -- without a torch op in between: at
decode sizes the ~20 ops' dispatch cost more than the experts' GEMMs. `expert_map` (expert parallel) maps
each global expert to this rank's index, or to the local count for another rank's expert (those pairs add
nothing). `lora` (pages of x's dtype), the layer's expert LoRA as the Triton kernel reads it
(`kernels/moe_lora_meta.py`), adds each pair's own adapter's delta for its expert to both projections
inside the same call, reading the pool's pages in place. Float32 or bfloat16, one dtype for all tensors.
The library holds the kernel at several instruction-set levels (as `kernels/moe_gemm_cpu.py`); the best
this CPU runs is used unless `isa=` names another. Threads: torch's intra-op count at the call.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from kernels.moe_gemm_cpu import _X86_ISAS
from kernels.moe_lora_meta import MoELoRA, check_lora
from kernels.native_build import build_isa_levels, isa_entry

_SHORT = {torch.float32: "float", torch.bfloat16: "bf16"}
_I64, _VP, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGS = [_VP, _I64, _I64, _I64, _VP, _I64, _VP, _VP, _VP, _I64, _I64, _I64, _INT, _VP, _I64, _VP, _VP, _VP,
         _INT]  # fmt: skip
_OP = "fused_moe_cpu"


class _LoRAProj(ctypes.Structure):
    """`moe_lora_proj` of csrc/moe_fused_cpu.c: one projection's pages, page tables and scalings."""

    _fields_ = [("a", _VP), ("b", _VP), ("page_a", _I64), ("page_b", _I64), ("rank", _I64),
                ("pages", _VP), ("width", _I64), ("scale", _VP)]  # fmt: skip


class _LoRALayer(ctypes.Structure):
    """`moe_lora_layer` of csrc/moe_fused_cpu.c: each token's adapter and both projections."""

    _fields_ = [("token_adapter", _VP), ("num_adapters", _I64), ("gate_up", _LoRAProj), ("down", _LoRAProj)]


@functools.cache
def _library() -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """The compiled library and the ISA names this CPU runs, lowest first. Raises NativeBuildError."""
    return build_isa_levels(
        "moe_fused_cpu.c", "MOE_ISA", _X86_ISAS, "moe_fused_isa_supported", ("-Wno-psabi",)
    )


def available_isas() -> tuple[str, ...]:
    """The instruction-set levels this CPU runs, lowest first (e.g. generic, avx2, avx512bf16)."""
    return _library()[1]


@functools.cache
def _entry(dtype: torch.dtype, isa: str | None):
    return isa_entry(_library(), _OP, f"moe_fused_{_SHORT[dtype]}", isa, _ARGS)


def _check(x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, top_k: int, emap: Tensor | None) -> None:
    """ValueError unless the tensors are what the kernel takes."""
    if x.dtype not in _SHORT or any(t.dtype != x.dtype for t in (router, gate_up, down)):
        raise ValueError(f"{_OP}: x and the weights must share one dtype of float32/bfloat16, got "
                         f"{x.dtype}, {router.dtype}, {gate_up.dtype}, {down.dtype}")  # fmt: skip
    tensors = (x, router, gate_up, down) + (() if emap is None else (emap,))
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{_OP}: tensors must be on the CPU")
    num_experts, hidden = router.shape
    held, inter2, _ = gate_up.shape
    if (x.dim() != 2 or x.shape[1] != hidden or gate_up.shape[2] != hidden or inter2 % 2
            or down.shape != (held, hidden, inter2 // 2)):  # fmt: skip
        raise ValueError(f"{_OP}: shapes x {tuple(x.shape)}, router {tuple(router.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)} do not fit")  # fmt: skip
    if not (router.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError(f"{_OP}: the router and expert weights must be contiguous")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"{_OP}: x must be contiguous in its last dim")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{_OP}: top_k must be in 1..{num_experts}, got {top_k}")
    if emap is None and held != num_experts:
        raise ValueError(f"{_OP}: {held} experts held of {num_experts} routed needs an expert_map")
    if emap is not None and (
        emap.dtype != torch.int64 or emap.shape != (num_experts,) or not emap.is_contiguous()
    ):  # fmt: skip  (its values: the caller's)
        raise ValueError(f"{_OP}: expert_map must be a contiguous int64 [{num_experts}] in 0..{held}")


def _lora_struct(lora: MoELoRA, tokens: int, gate_up: Tensor, down: Tensor) -> _LoRALayer:
    """The C view of `lora` after checking it fits (ValueError): CPU pages of the weights' dtype whose
    experts and pages' rows are contiguous, int64 token adapters, int32 page tables, float32 scalings."""
    held, hidden, inter = gate_up.shape[0], gate_up.shape[2], down.shape[2]
    check_lora(lora, tokens, held, {"gate_up": hidden, "down": inter}, {"gate_up": 2 * inter, "down": hidden},
               torch.device("cpu"))  # fmt: skip
    adapters = lora.token_adapter
    if adapters.dtype != torch.int64 or not adapters.is_contiguous():
        raise ValueError(f"{_OP}: lora.token_adapter must be a contiguous int64 tensor")
    if tokens and not 0 <= int(adapters.min()) <= int(adapters.max()) <= lora.num_adapters:
        raise ValueError(f"{_OP}: lora.token_adapter must lie in [0, {lora.num_adapters}]")
    projs = []
    for name in ("gate_up", "down"):
        w = getattr(lora, name)
        if w is None:
            projs.append(_LoRAProj())
            continue
        _, _, rank, fin = w.a.shape
        fout = w.b.shape[2]
        if w.a.dtype != gate_up.dtype or w.a.stride()[1:] != (rank * fin, fin, 1) \
                or w.b.stride()[1:] != (fout * rank, rank, 1):  # fmt: skip
            raise ValueError(f"{_OP}: lora.{name} pages must be {gate_up.dtype} with contiguous experts")
        if not (w.pages.is_contiguous() and w.scale.is_contiguous()):
            raise ValueError(f"{_OP}: lora.{name} page table and scalings must be contiguous")
        if w.pages.numel() and not -1 <= int(w.pages.min()) <= int(w.pages.max()) < w.a.shape[0]:
            raise ValueError(f"{_OP}: lora.{name} page ids must lie in [-1, {w.a.shape[0]})")
        projs.append(_LoRAProj(w.a.data_ptr(), w.b.data_ptr(), w.a.stride(0), w.b.stride(0), rank,
                               w.pages.data_ptr(), w.pages.shape[1], w.scale.data_ptr()))  # fmt: skip
    return _LoRALayer(lora.token_adapter.data_ptr(), lora.num_adapters, *projs)


def fused_moe_cpu(
    x: Tensor,  # [T, H], last dim contiguous
    router: Tensor,  # [E, H] the router's weight
    gate_up: Tensor,  # [EL, 2I, H] gate rows first
    down: Tensor,  # [EL, H, I]
    top_k: int,
    norm_topk_prob: bool,
    expert_map: Tensor | None = None,  # int64 [E] -> 0..EL (EL: another rank's expert)
    routing: tuple[Tensor, Tensor] | None = None,  # (ids int64 [T, k], weights float32 [T, k]) written
    isa: str | None = None,
    lora: MoELoRA | None = None,  # the layer's expert LoRA, pages of x's dtype
) -> Tensor:
    """The routed experts' weighted output [T, H] (module docstring); the routing it chose written into
    `routing` when given; raises ValueError for tensors the kernel does not take."""
    _check(x, router, gate_up, down, top_k, expert_map)
    out = x.new_empty(x.shape)
    tokens = x.shape[0]
    if not tokens:
        return out
    ids_ptr = w_ptr = None
    if routing is not None:
        ids, w = routing
        if ids.dtype != torch.int64 or w.dtype != torch.float32 or ids.shape != (tokens, top_k) \
                or w.shape != ids.shape or not (ids.is_contiguous() and w.is_contiguous()):  # fmt: skip
            raise ValueError(f"{_OP}: routing must be contiguous (int64, float32) [{tokens}, {top_k}]")
        ids_ptr, w_ptr = ids.data_ptr(), w.data_ptr()
    c_lora = None if lora is None else _lora_struct(lora, tokens, gate_up, down)
    rc = _entry(x.dtype, isa)(
        x.data_ptr(), x.stride(0), tokens, x.shape[1], router.data_ptr(), router.shape[0],
        None if expert_map is None else expert_map.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
        gate_up.shape[0], down.shape[2], top_k, int(norm_topk_prob), out.data_ptr(), out.stride(0),
        ids_ptr, w_ptr, None if c_lora is None else ctypes.addressof(c_lora), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"{_OP}: out of memory")
    return out
