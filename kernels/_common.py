"""Shared launcher helpers: input checks with clear errors, pointer tables for multi-slice pools."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

_PTR_TABLE_CACHE: OrderedDict[tuple, Tensor] = OrderedDict()
_PTR_TABLE_CACHE_SIZE = 4096


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    last_contiguous: bool = True,
    contiguous: bool = False,
) -> Tensor:
    """Raise ``ValueError`` unless ``t`` is a tensor with the given rank, dtype, device and layout."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected one of: {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device} (all inputs on one device)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (strides {t.stride()})")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dim (strides {t.stride()})")
    return t


def check_shape(op: str, name: str, t: Tensor, expected: Sequence[int | None]) -> None:
    """Raise ``ValueError`` unless ``t.shape`` matches ``expected`` (``None`` = any size)."""
    if len(t.shape) != len(expected) or any(
        e is not None and e != s for s, e in zip(t.shape, expected, strict=True)
    ):
        want = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {want}")


def check_segment_meta(op: str, meta, rows: Tensor, rows_name: str, device: torch.device) -> None:
    """ValueError unless the SGMV metadata `meta` (`kernels.lora_meta`) covers `rows`' first dimension and
    its four index tensors are 1-D int32 on `device`."""
    if meta.num_tokens != rows.shape[0]:
        raise ValueError(f"{op}: meta has {meta.num_tokens} tokens but {rows_name} has {rows.shape[0]}")
    for name in ("token_indices_sorted", "slot_ids", "slot_token_counts", "slot_token_starts"):
        check_tensor(op, f"meta.{name}", getattr(meta, name), ndim=1, dtypes=(torch.int32,), device=device)


def check_runnable(op: str, device: torch.device, interpreted: bool) -> None:
    """Triton kernels run on CUDA, or on CPU only under ``TRITON_INTERPRET=1`` (set before import)."""
    if device.type == "cuda" or (device.type == "cpu" and interpreted):
        return
    raise ValueError(
        f"{op}: tensors on {device} cannot run the Triton kernel; use CUDA tensors, or on CPU the "
        "kernels.reference ops (or set TRITON_INTERPRET=1 before triton is imported)"
    )


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated while ``TRITON_INTERPRET=1`` (runs on CPU via numpy)."""
    return type(kernel).__name__ == "InterpretedFunction"


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 for fp32 inputs, native for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pointer_table(pools: Sequence[Tensor], extra: Sequence[Sequence[int]] | None = None) -> Tensor:
    """An int64 table ``[len(pools), 3 + k]``: ``(data_ptr, stride(0), stride(1), *extra[i])`` per pool.

    Cached by content (pointers and strides), so a per-layer view of a persistent pool builds its
    table once and later calls do no host-to-device copy.
    """
    rows = [
        (p.data_ptr(), p.stride(0), p.stride(1), *(extra[i] if extra is not None else ()))
        for i, p in enumerate(pools)
    ]
    key = (pools[0].device, tuple(rows))
    table = _PTR_TABLE_CACHE.get(key)
    if table is None:
        table = torch.tensor(rows, dtype=torch.int64, device=pools[0].device)
        _PTR_TABLE_CACHE[key] = table
        if len(_PTR_TABLE_CACHE) > _PTR_TABLE_CACHE_SIZE:
            _PTR_TABLE_CACHE.popitem(last=False)
    else:
        _PTR_TABLE_CACHE.move_to_end(key)
    return table


def live_pointer_tables() -> list[Tensor]:
    """The pointer tables cached now. A CUDA graph that captured launches reading some of them keeps this
    list, so that a table evicted from the cache later is not freed under the graph."""
    return list(_PTR_TABLE_CACHE.values())


def launch(op: Callable[..., None], impl: Callable[..., None]) -> Callable[..., None]:
    """The launcher to call: the registered custom op ``op`` while ``torch.compile`` traces (the graph
    then holds one opaque op), else the plain launcher ``impl``. In eager mode the custom-op dispatcher
    costs about as much host time per call as a decode-sized kernel runs on a GPU."""
    return op if torch.compiler.is_compiling() else impl
