"""The torch backend's paths for short query runs (speculative verification rows, small chunks) — the
batched SDPA path and the native CPU kernel — equal the reference paged attention, next to decodes and a
long prefill chunk, with GQA."""

from __future__ import annotations

import pytest
import torch

from engine.attention.short_runs import SHORT_RUN_MAX_ROWS
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref
from tests.engine.attention_case import attention_case


@pytest.fixture
def threads(request):
    """torch's thread count for the test (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("native", "threads"), [(False, 2), (True, 2), (True, 16)], ids=["torch", "native", "native-16-threads"],
    indirect=["threads"],
)  # fmt: skip
def test_short_runs_match_reference(native, threads):
    # two decodes; then runs of 5, 2, a long chunk of 30, 17 (the longest short run) and 3 rows
    q_lens = [1, 1, 5, 2, 30, SHORT_RUN_MAX_ROWS, 3]
    seq_lens = [6, 11, 9, 2, 41, 40, 4]
    c = attention_case(3, 64, 4, 2, 8, 16, seq_lens=seq_lens, q_lens=q_lens, num_decodes=2)
    q, k_cache, v_cache, tables, meta = c.q, c.k_cache, c.v_cache, c.tables, c.meta
    backend = TorchAttentionBackend(native=native)
    out = backend.attend(q, k_cache, v_cache, meta, 0.25)
    step = backend.native.step(q, k_cache, meta)
    # Work (rows x keys) per sequence: 6, 11, 45, 4, 1230, 680, 12; 2 KV heads each.
    if native and threads == 2:  # a thread's share is 1988 x 2 / 2: every item fits, the kernel takes all
        assert step is not None and step.call.num_seqs == 7 and step.rest == [] and not backend._shorts
    elif native:  # a share of 1988 x 2 / 16 = 248: the 30-row chunk (1230) would hold up one of 16
        # threads, so SDPA takes it; the 17-row run (680) is a short run, the kernel's
        assert step is not None and step.call.num_seqs == 6 and step.rest == [4] and not backend._shorts
    else:
        assert step is None and backend._shorts[0].num_seqs == 4
    ref_dec = paged_attention_decode_ref(q[:2], k_cache, v_cache, tables[:2], meta.seq_lens[:2], 0.25)
    starts = meta.query_start_loc[2:] - 2
    ref_pre = paged_attention_prefill_ref(
        q[2:], k_cache, v_cache, tables[2:], starts, meta.seq_lens[2:], 0.25
    )
    torch.testing.assert_close(out[:2], ref_dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2:], ref_pre, rtol=1e-5, atol=1e-5)
    again = backend.attend(q, k_cache, v_cache, meta, 0.25)  # the plan is reused by the next layer
    torch.testing.assert_close(again, out, rtol=0, atol=0)
