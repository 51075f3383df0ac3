"""Launchers reject bad inputs with clear ValueErrors before launching anything."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels._common import check_runnable
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv
from tests.kernels.lora_case import make_case

CASE = make_case([[4, 8], [8, 0]], [0, 1, -1], 16, [16, 8], 8, torch.float32)


def _shrink(**kw) -> None:
    args = dict(x=CASE.x, a_pools=CASE.a_pools, page_table=CASE.page_table, ranks=CASE.ranks, meta=CASE.meta)
    args["out"] = torch.zeros(2, 3, 8)
    args.update(kw)
    lora_shrink(**args)


def _expand(**kw) -> None:
    args = dict(v=torch.zeros(2, 3, 8), b_pools=CASE.b_pools, page_table=CASE.page_table, ranks=CASE.ranks)
    args.update(scalings=CASE.scalings, meta=CASE.meta, y=torch.zeros(3, 24))
    args.update(kw)
    lora_expand(**args)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: _shrink(x=CASE.x.long()), "x has dtype"),
        (lambda: _shrink(x=CASE.x.half()), r"a_pools\[0\] has dtype"),
        (lambda: _shrink(x=CASE.x[:, :8]), r"a_pools\[0\] has shape"),
        (lambda: _shrink(a_pools=[]), "one pool per slice"),
        (lambda: _shrink(a_pools=[p.transpose(1, 2) for p in CASE.a_pools]), "contiguous in its last dim"),
        (lambda: _shrink(page_table=CASE.page_table.long()), "page_table has dtype"),
        (lambda: _shrink(ranks=CASE.ranks[:1]), "ranks has shape"),
        (lambda: _shrink(out=torch.zeros(2, 3, 8, dtype=torch.float16)), "out has dtype"),
        (lambda: _shrink(out=torch.zeros(3, 3, 8)), "out has shape"),
        (lambda: _shrink(out=torch.zeros(2, 3, 8, device="meta")), "out is on meta"),
        (lambda: _shrink(x=CASE.x[:2], out=torch.zeros(2, 2, 8)), "meta has 3 tokens"),
        (lambda: _expand(y=torch.zeros(3, 20)), "y has shape"),
        (lambda: _expand(y=torch.zeros(3, 24, dtype=torch.float16)), r"b_pools\[0\] has dtype"),
        (lambda: _expand(v=torch.zeros(1, 3, 8)), "v has shape"),
        (lambda: _expand(v=torch.zeros(2, 3, 8, dtype=torch.float64)), "v has dtype"),
        (lambda: _expand(scalings=CASE.scalings.double()), "scalings has dtype"),
        (lambda: _expand(b_pools=[CASE.b_pools[0], CASE.b_pools[1][:, :, :4]]), r"b_pools\[1\] has shape"),
    ],
)
def test_lora_launchers_reject(call: Callable[[], None], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def _attn_inputs() -> dict:
    return dict(
        q=torch.zeros(2, 4, 16),
        k_cache=torch.zeros(5, 4, 2, 16),
        v_cache=torch.zeros(5, 4, 2, 16),
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        scale=0.25,
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"q": torch.zeros(2, 3, 16)}, "multiple of KV heads"),
        ({"q": torch.zeros(2, 4, 8)}, "head_dim"),
        ({"q": torch.zeros(2, 4, 16, dtype=torch.float16)}, "k_cache has dtype"),
        ({"v_cache": torch.zeros(5, 4, 2, 16).transpose(0, 1).contiguous().transpose(0, 1)}, "v_cache must"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables has dtype"),
        ({"block_tables": torch.zeros(3, 3, dtype=torch.int32)}, "block_tables has shape"),
        ({"seq_lens": torch.ones(2)}, "seq_lens has dtype"),
        ({"k_cache": torch.zeros(5, 4, 2, 32)[..., ::2]}, "last dim"),
    ],
)
def test_attention_launchers_reject(change: dict, match: str) -> None:
    decode_args = {**_attn_inputs(), **change}
    with pytest.raises(ValueError, match=match):
        paged_attention_decode(**decode_args)
    prefill_args = {**decode_args, "query_start_loc": torch.tensor([0, 1, 2], dtype=torch.int32)}
    with pytest.raises(ValueError, match=match):
        paged_attention_prefill(**prefill_args)


def test_prefill_rejects_bad_query_start_loc() -> None:
    with pytest.raises(ValueError, match="query_start_loc has shape"):
        paged_attention_prefill(**_attn_inputs(), query_start_loc=torch.tensor([0, 2], dtype=torch.int32))


def test_write_kv_rejects() -> None:
    key, cache = torch.zeros(3, 2, 16), torch.zeros(5, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        write_kv(key, key, cache, cache.clone(), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="k_cache has shape"):
        write_kv(
            key, key, torch.zeros(5, 4, 3, 16), torch.zeros(5, 4, 3, 16), torch.zeros(3, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="slot_mapping has dtype"):
        write_kv(key, key, cache, cache.clone(), torch.zeros(3))


def test_cpu_without_interpreter_is_refused() -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        check_runnable("op", torch.device("cpu"), interpreted=False)
    check_runnable("op", torch.device("cuda"), interpreted=False)
