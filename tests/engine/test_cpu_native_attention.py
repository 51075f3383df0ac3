"""The torch backend's native CPU attention path: it serves decode rows and short runs in the model dtype,
follows torch's thread count step by step, and falls back to the torch path when the kernel cannot be
built — same results as the reference either way."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from kernels import paged_attention_cpu
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref
from tests.engine.attention_case import attention_case
from tests.helpers.broken_compiler import use_broken_compiler


def _case(seed=1, dtype=torch.float32):
    c = attention_case(seed, 40, 4, 2, 8, 16, seq_lens=[1, 9, 13, 30], q_lens=[1, 1, 4, 1], num_decodes=2)
    return c.q.to(dtype), c.k_cache.to(dtype), c.v_cache.to(dtype), c.tables, c.meta


def _reference(q, k, v, tables, meta, scale):
    return paged_attention_prefill_ref(q, k, v, tables, meta.query_start_loc, meta.seq_lens, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_model_dtype_caches_match_reference(dtype):
    q, k, v, tables, meta = _case(2, dtype)
    backend = TorchAttentionBackend()
    out = backend.attend(q, k, v, meta, 0.3)
    assert backend.native.steps_served == 1
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, _reference(q, k, v, tables, meta, 0.3), rtol=tol, atol=tol)
    dec = paged_attention_decode_ref(q[:2], k, v, tables[:2], meta.seq_lens[:2], 0.3)
    torch.testing.assert_close(out[:2], dec, rtol=tol, atol=tol)


def test_plan_per_step_follows_the_thread_count():
    q, k, v, _, meta = _case()
    backend = TorchAttentionBackend()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.attend(q, k, v, meta, 0.3)
        assert backend.native.step(q, k, meta).call.num_threads == 1  # the same step: the same plan
        torch.set_num_threads(2)
        assert backend.native.step(q, k, meta).call.num_threads == 1
        _, _, _, _, meta2 = _case()  # the next step's metadata: a new plan at the new count
        two = backend.attend(q, k, v, meta2, 0.3)
        assert backend.native.step(q, k, meta2).call.num_threads == 2
        assert backend.native.steps_served == 2
        assert torch.equal(one, two)
    finally:
        torch.set_num_threads(threads)


def test_torch_path_when_the_kernel_cannot_be_built(monkeypatch, tmp_path, caplog):
    use_broken_compiler(monkeypatch, tmp_path)
    paged_attention_cpu.forget_library()
    try:
        q, k, v, tables, meta = _case(3)
        backend = TorchAttentionBackend()
        with caplog.at_level(logging.WARNING):
            out = backend.attend(q, k, v, meta, 0.3)
        assert backend.native.steps_served == 0 and "torch path" in caplog.text
        torch.testing.assert_close(out, _reference(q, k, v, tables, meta, 0.3), rtol=1e-5, atol=1e-5)
        _, _, _, _, meta2 = _case(3)
        backend.attend(q, k, v, meta2, 0.3)  # no second build attempt
        assert caplog.text.count("torch path") == 1
    finally:
        paged_attention_cpu.forget_library()


def test_native_off_and_unsupported_head_size_take_the_torch_path():
    q, k, v, tables, meta = _case(4)
    off = TorchAttentionBackend(native=False)
    out = off.attend(q, k, v, meta, 0.3)
    assert off.native.steps_served == 0
    torch.testing.assert_close(out, _reference(q, k, v, tables, meta, 0.3), rtol=1e-5, atol=1e-5)
    big = torch.randn(3, 4, 2, 272)  # head dim above the kernel's 256
    c = attention_case(5, 3, 4, 2, 2, 272, seq_lens=[5], q_lens=[1], num_decodes=1)
    backend = TorchAttentionBackend()
    out = backend.attend(c.q, big, big, c.meta, 0.1)
    assert backend.native.steps_served == 0
    ref = _reference(c.q, big, big, c.tables, c.meta, 0.1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
