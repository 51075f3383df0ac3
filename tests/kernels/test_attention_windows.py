"""Sliding-window attention and attention-logit soft-capping in every attention path, each vs the torch
reference: the reference itself vs attention over the window's keys sliced out, the native CPU kernel at
every instruction-set level this CPU runs, the Triton kernels (interpreted), and the torch backend's SDPA
paths (decodes, batched short runs, long chunks one by one) with the native kernel off and on.

The case mixes decodes, short runs and a long chunk whose rows start before and end after window
boundaries; windows of 1 (a row sees itself), smaller than a block, a few blocks, and wider than every
sequence (= no window)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_backend import TorchAttentionBackend
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill
from kernels.paged_attention_cpu import available_isas, paged_attention_cpu
from kernels.reference import _gather_kv, paged_attention_decode_ref, paged_attention_prefill_ref
from tests.engine.attention_case import AttentionCase, attention_case

WINDOWS = [1, 3, 8, 21, 500]
SOFTCAPS = [0.0, 2.5]
SEQ_LENS = [9, 40, 1, 23, 30, 64]
Q_LENS = [1, 1, 1, 5, 17, 40]  # three decodes, two short runs, one long chunk
SCALE = 0.4


def _case(kv_dtype: torch.dtype = torch.float32, block_size: int = 4) -> AttentionCase:
    case = attention_case(7, 60, block_size, 2, 8, 16, SEQ_LENS, Q_LENS, num_decodes=3)
    case.k_cache, case.v_cache = case.k_cache.to(kv_dtype), case.v_cache.to(kv_dtype)
    case.q = case.q * 3  # scores of several units: the soft-cap bends them
    return case


def _ref(case: AttentionCase, window: int, softcap: float) -> torch.Tensor:
    m = case.meta
    return paged_attention_prefill_ref(
        case.q, case.k_cache, case.v_cache, case.tables, m.query_start_loc, m.seq_lens, SCALE, window, softcap
    )


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [3, 21])
def test_reference_window_is_attention_over_the_windows_keys(window):
    """Each row of the reference equals plain attention over exactly its last `window` keys; the
    soft-capped reference equals HF's eager formula (cap the scores, then mask, then softmax)."""
    case = _case()
    m = case.meta
    for softcap in SOFTCAPS:
        ref = _ref(case, window, softcap)
        for b, length in enumerate(m.seq_lens_list):
            k = _gather_kv(case.k_cache, case.tables[b], length)
            v = _gather_kv(case.v_cache, case.tables[b], length)
            for i in range(m.query_start_list[b + 1] - m.query_start_list[b]):
                row = m.query_start_list[b] + i
                pos = length - (m.query_start_list[b + 1] - m.query_start_list[b]) + i
                lo = max(0, pos - window + 1)
                kw, vw = k[lo : pos + 1].repeat_interleave(4, 1), v[lo : pos + 1].repeat_interleave(4, 1)
                scores = torch.einsum("hd,khd->hk", case.q[row].float(), kw) * SCALE
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                want = torch.einsum("hk,khd->hd", scores.softmax(-1), vw)
                _close(ref[row], want, 1e-5)
    no_window = paged_attention_prefill_ref(
        case.q, case.k_cache, case.v_cache, case.tables, m.query_start_loc, m.seq_lens, SCALE
    )
    assert not torch.allclose(_ref(case, window, 0.0), no_window)  # the window matters in this case
    assert torch.equal(_ref(case, 500, 0.0), no_window)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_kernel_windows_and_softcap(isa, kv_dtype):
    if isa not in available_isas():
        pytest.skip(f"this CPU does not run the {isa} kernel")
    case = _case(kv_dtype)
    m = case.meta
    for window in WINDOWS:
        for softcap in SOFTCAPS:
            out = paged_attention_cpu(
                case.q, case.k_cache, case.v_cache, case.tables, m.seq_lens, m.query_start_loc, SCALE,
                isa=isa, window=window, softcap=softcap,
            )  # fmt: skip
            _close(out, _ref(case, window, softcap))


def test_native_kernel_windows_with_large_blocks():
    """Blocks of 64 keys (two 32-key chunks each): a window starting inside a chunk, chunks that a row's
    window skips entirely, and a window edge on a chunk edge."""
    case = _case(block_size=64)
    m = case.meta
    for window in (5, 32, 33):
        args = (case.q, case.k_cache, case.v_cache, case.tables, m.seq_lens, m.query_start_loc, SCALE)
        out = paged_attention_cpu(*args, window=window)
        _close(out, _ref(case, window, 0.0))


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_triton_windows_and_softcap(softcap):
    case = _case()
    m = case.meta
    nd = m.num_decodes
    for window in (1, 8, 500):
        ref = _ref(case, window, softcap)
        dec = paged_attention_decode(
            case.q[:nd], case.k_cache, case.v_cache, case.tables[:nd], m.seq_lens[:nd], SCALE, window, softcap
        )
        dec_ref = paged_attention_decode_ref(
            case.q[:nd], case.k_cache, case.v_cache, case.tables[:nd], m.seq_lens[:nd], SCALE, window, softcap
        )
        _close(dec, dec_ref, 2e-4)
        pre = paged_attention_prefill(
            case.q, case.k_cache, case.v_cache, case.tables, m.query_start_loc, m.seq_lens, SCALE,
            m.max_query_len, window, softcap,
        )  # fmt: skip
        _close(pre, ref, 2e-4)


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native"])
def test_torch_backend_windows_and_softcap(native):
    """The backend's paths in one step, layer after layer with different windows and caps (the per-step
    plans are keyed by window): each layer's output equals the reference's."""
    case = _case()
    backend = TorchAttentionBackend(native=native)
    for window in [*WINDOWS, 0, 3]:
        for softcap in SOFTCAPS:
            out = backend.attend(case.q, case.k_cache, case.v_cache, case.meta, SCALE, window, softcap)
            _close(out, _ref(case, window, softcap))
    assert backend.native.steps_served == (1 if native else 0)


def test_sdpa_long_chunk_gathers_only_the_windows_blocks():
    """A long chunk's SDPA call over the blocks its rows see (from the first window's block on) gives the
    same rows as attention over the whole gathered context with the window mask."""
    case = _case()
    m = case.meta
    backend = TorchAttentionBackend(native=False)
    out = torch.zeros_like(case.q)
    backend._attend_one(case.q, case.k_cache, case.v_cache, m, SCALE, 5, out, 8, 0.0)
    lo, hi = m.query_start_list[5], m.query_start_list[6]
    k = _gather_kv(case.k_cache, case.tables[5], 64).repeat_interleave(4, 1).transpose(0, 1)
    v = _gather_kv(case.v_cache, case.tables[5], 64).repeat_interleave(4, 1).transpose(0, 1)
    qpos, kpos = torch.arange(24, 64)[:, None], torch.arange(64)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - 8)
    want = F.scaled_dot_product_attention(case.q[lo:hi].transpose(0, 1), k, v, attn_mask=mask, scale=SCALE)
    _close(out[lo:hi], want.transpose(0, 1))
