"""CPU paged attention for decode rows and short query runs: the native kernel
(``csrc/paged_attention_cpu.c``) and its launcher.

It reads each sequence's K/V blocks where they lie in the cache (no gather), with one online softmax per
(sequence, KV head) and the ``Hq / Hkv`` query heads of a KV head together. Semantics are those of
``kernels.reference.paged_attention_prefill_ref`` (and, for one query row per sequence,
``paged_attention_decode_ref``), computed in float32, with its sliding window and soft-capping. Caches
are float32, bfloat16 or float16; queries and output likewise, independently.

The library holds the kernel at several instruction-set levels (x86-64: generic, AVX2, AVX-512); the best
one this CPU runs is picked when it is loaded (`best_isa`), a lower one on request (`isa=`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from kernels._common import FLOAT_DTYPES, check_shape, check_tensor
from kernels.native_build import AVX2_FLAGS, AVX512_FLAGS, build_isa_levels

_OP = "paged_attention_cpu"
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_I64, _VP = ctypes.c_int64, ctypes.c_void_p
# q, q_row, q_head, k, v, tables, table_stride, seq_lens, query_start, seqs, num_seqs, out, o_row,
# o_head, hq, hkv, d, block_size, scale, window, softcap, num_threads
_ARGTYPES = [_VP, _I64, _I64, _VP, _VP, _VP, _I64, _VP, _VP, _VP, _I64, _VP, _I64, _I64]
_ARGTYPES += [_I64, _I64, _I64, _I64, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int]
MAX_HEAD_DIM = 256  # DMAX in the C source

# Instruction-set levels the library is built for on x86-64, lowest first: (name, extra compiler flags).
_X86_ISAS = (("generic", ()), ("avx2", AVX2_FLAGS), ("avx512", AVX512_FLAGS))


@functools.cache
def _library() -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """The compiled library and the ISA names it has that this CPU runs, lowest first (built on first use).
    Raises NativeBuildError."""
    return build_isa_levels("paged_attention_cpu.c", "PA_ISA", _X86_ISAS, "paged_attention_isa_supported")


def forget_library() -> None:
    """Drop the loaded library and entry points, so the next use builds (or loads) it again (tests)."""
    _library.cache_clear()
    _kernels.cache_clear()


def available_isas() -> tuple[str, ...]:
    """The kernel's instruction-set levels this CPU runs, lowest first (e.g. generic, avx2, avx512)."""
    return _library()[1]


def best_isa() -> str:
    """The level used when none is named: the highest in `available_isas()`."""
    return available_isas()[-1]


@functools.cache
def _kernels(isa: str | None = None) -> dict[tuple[torch.dtype, torch.dtype], Callable[..., int]]:
    """Entry points by (query dtype, cache dtype) at `isa` (default: the best). Raises NativeBuildError."""
    lib, runs = _library()
    isa = isa or runs[-1]
    if isa not in runs:
        raise ValueError(f"{_OP}: instruction set {isa!r} is not available here (have {', '.join(runs)})")
    out = {}
    for q_dtype, q_name in _SHORT.items():
        for kv_dtype, kv_name in _SHORT.items():
            if torch.float16 in (q_dtype, kv_dtype) and not lib.paged_attention_has_f16():
                continue  # the compiler has no _Float16
            fn = getattr(lib, f"paged_attention_{q_name}_{kv_name}_{isa}")
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            out[(q_dtype, kv_dtype)] = fn
    return out


def supported(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the native kernel runs this configuration here (builds it on first use; raises
    NativeBuildError when it cannot be built)."""
    return (q_dtype, cache_dtype) in _kernels() and 1 <= head_dim <= MAX_HEAD_DIM


class PreparedPagedAttention:
    """The kernel for one step's sequences at every layer: block tables, lengths and query runs checked
    once, their pointers kept, so a call (one layer) is one foreign-function call.

    `seqs` are the sequences to attend (indices into the metadata, each with 1..seq_len query rows);
    it keeps references to its tensors, so the pointers it holds stay valid.
    """

    def __init__(
        self,
        block_tables: Tensor,  # [B, max_blocks] int32, last dim contiguous
        seq_lens: Tensor,  # [B] int32: context length including this step's tokens
        query_start_loc: Tensor,  # [B + 1] int32: sequence b's query rows are qsl[b] .. qsl[b+1]-1
        seqs: Sequence[int],  # which sequences to attend
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D] contiguous: a probe for the shape and dtype
        q_dtype: torch.dtype,
        num_heads: int,  # Hq
        num_threads: int = 1,
        isa: str | None = None,
    ) -> None:
        kernels = _kernels(isa)
        check_tensor(_OP, "k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, contiguous=True)
        num_blocks, block_size, hkv, d = k_cache.shape
        if (q_dtype, k_cache.dtype) not in kernels:
            raise ValueError(
                f"{_OP}: no native kernel for {q_dtype} queries and a {k_cache.dtype} cache here"
            )
        if not 1 <= d <= MAX_HEAD_DIM or num_heads % hkv != 0:
            raise ValueError(f"{_OP}: head dim {d} (at most {MAX_HEAD_DIM}) or {num_heads} heads over {hkv}")
        check_tensor(_OP, "block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
        check_tensor(_OP, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
        check_tensor(_OP, "query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), contiguous=True)
        num_seqs = seq_lens.shape[0]
        check_shape(_OP, "block_tables", block_tables, (num_seqs, None))
        check_shape(_OP, "query_start_loc", query_start_loc, (num_seqs + 1,))
        if any(t.device.type != "cpu" for t in (block_tables, seq_lens, query_start_loc)):
            raise ValueError(f"{_OP}: block tables, lengths and query starts must be CPU tensors")
        idx_np = np.fromiter(seqs, dtype=np.int32)
        if idx_np.size and (int(idx_np.min()) < 0 or int(idx_np.max()) >= num_seqs):
            raise ValueError(f"{_OP}: seqs must index the {num_seqs} sequences")
        _check_runs(block_tables, seq_lens, query_start_loc, idx_np, num_blocks, block_size)
        idx = torch.from_numpy(idx_np)
        self._keep = (block_tables, seq_lens, query_start_loc, idx)
        self._fn = kernels[(q_dtype, k_cache.dtype)]
        self.q_dtype, self.cache_dtype, self.shape = q_dtype, k_cache.dtype, tuple(k_cache.shape)
        self.num_heads, self.num_seqs = num_heads, idx.numel()
        self._meta = (
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(),
            idx.data_ptr(), idx.numel(),
        )  # fmt: skip
        self._dims = (num_heads, hkv, d, block_size)
        self.num_threads = num_threads

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        out: Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """Write the attention of the prepared sequences' query rows of ``q [T, Hq, D]`` into the same
        rows of ``out [T, Hq, D]``. Caches of the probe's shape and dtype, contiguous; q and out of the
        prepared dtype with unit last stride (not checked here: the caller owns them, `paged_attention_cpu`
        checks). ``window`` and ``softcap`` (0: none) are the layer's, as in the reference."""
        self._fn(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), *self._meta,
            out.data_ptr(), out.stride(0), out.stride(1), *self._dims, scale, max(int(window), 0),
            max(float(softcap), 0.0), self.num_threads,
        )  # fmt: skip


def paged_attention_cpu(
    q: Tensor,  # [T, Hq, D] float32, bfloat16 or float16, last dim contiguous
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D] contiguous, float32, bfloat16 or float16
    v_cache: Tensor,  # like k_cache
    block_tables: Tensor,  # [B, max_blocks] int32
    seq_lens: Tensor,  # [B] int32
    query_start_loc: Tensor,  # [B + 1] int32
    scale: float,
    out: Tensor | None = None,  # [T, Hq, D] q's dtype; rows of sequences not in `seqs` are left alone
    seqs: Sequence[int] | None = None,  # default: all sequences
    num_threads: int = 1,
    isa: str | None = None,
    window: int = 0,  # > 0: each row sees its last `window` positions (sliding window)
    softcap: float = 0.0,  # > 0: attention-logit soft-capping
) -> Tensor:
    """Causal paged attention of every query row of `seqs` (see `kernels.reference`'s prefill op), with
    all inputs checked. Returns `out`."""
    check_tensor(_OP, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    if out is None:
        out = torch.zeros_like(q)
    check_tensor(_OP, "out", out, ndim=3, dtypes=(q.dtype,))
    check_shape(_OP, "out", out, tuple(q.shape))
    check_tensor(_OP, "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), contiguous=True)
    check_shape(_OP, "v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.dim() == 4 and q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"{_OP}: q has head dim {q.shape[2]}, the cache {k_cache.shape[3]}")
    if query_start_loc.numel() and int(query_start_loc[-1]) > q.shape[0]:
        raise ValueError(
            f"{_OP}: query_start_loc ends at {int(query_start_loc[-1])}, q has {q.shape[0]} rows"
        )
    if query_start_loc.numel() and int(query_start_loc[0]) < 0:
        raise ValueError(f"{_OP}: query_start_loc must start at 0 or later")
    seqs = range(seq_lens.shape[0]) if seqs is None else seqs
    plan = PreparedPagedAttention(
        block_tables, seq_lens, query_start_loc, seqs, k_cache, q.dtype, q.shape[1], num_threads, isa
    )
    plan(q, k_cache, v_cache, out, scale, window, softcap)
    return out


def _check_runs(
    tables: Tensor, seq_lens: Tensor, qsl: Tensor, idx: np.ndarray, num_blocks: int, block_size: int
) -> None:
    """ValueError unless each listed sequence has 1..seq_len query rows, its length fits its table row,
    and the blocks it uses are blocks of the cache (the kernel reads them unchecked). Computed on numpy
    views of the (CPU) tensors: a few microseconds, once per step."""
    if not idx.size:
        return
    lens_all, qs = seq_lens.numpy().astype(np.int64), qsl.numpy().astype(np.int64)
    lens, rows = lens_all[idx], (qs[1:] - qs[:-1])[idx]
    if (rows < 1).any() or (rows > lens).any():
        raise ValueError(f"{_OP}: each sequence needs 1..seq_len query rows (query_start_loc vs seq_lens)")
    if (qs[1:] < qs[:-1]).any():
        raise ValueError(f"{_OP}: query_start_loc must not decrease")
    max_blocks = tables.shape[1]
    if int(lens.max()) > max_blocks * block_size:
        raise ValueError(f"{_OP}: a sequence is longer than its block table ({max_blocks} x {block_size})")
    used = np.arange(max_blocks)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    blocks = tables.numpy()[idx][used]
    if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"{_OP}: a block table names a block outside the cache's {num_blocks}")
