"""The "shm" KV connector (engine/kv_transfer/shm_stage.py): blocks staged in host shared memory are
received exactly as the byte connectors' are; bad files are refused and leave nothing allocated."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kv_transfer.connector import KVLayout, make_connector
from engine.kv_transfer.host_copy import HostCopyConnector
from engine.kv_transfer.shm_stage import PREFIX, SHM_DIR, shm_available, stage, sweep_orphans, unstage

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this host")

SHAPE = (3, 2, 10, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim


def _cache(seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_chunks_receive_like_the_host_connector(per_layer, dtype):
    src = _cache(0, dtype)
    sent = HostCopyConnector(per_layer).send("r", src, [7, 2, 5, 9], 15)
    staged = stage(sent.layout, sent.num_blocks, sent.num_tokens, [memoryview(c) for c in sent.chunks])
    try:
        assert staged.connector == "shm" and staged.nbytes == sent.nbytes and not staged.chunks
        want, got = _cache(1, dtype), _cache(1, dtype)
        HostCopyConnector(per_layer).receive(sent, want, [0, 3, 4], first=1)  # block 0 was cached here
        make_connector("shm").receive(staged, got, [0, 3, 4], first=1)
        assert torch.equal(got, want)
        assert torch.equal(got[:, :, [0, 3, 4]], src[:, :, [2, 5, 9]])
        assert not torch.equal(got, _cache(1, dtype))  # it did write
    finally:
        unstage(staged.path)
    assert not os.path.exists(staged.path)


def test_shm_send_then_receive_round_trips():
    src, dst = _cache(2), _cache(3)
    blocks = make_connector("shm").send("r", src, [1, 4], 8)
    try:
        make_connector("shm").receive(blocks, dst, [6, 0])
    finally:
        unstage(blocks.path)
    assert torch.equal(dst[:, :, [6, 0]], src[:, :, [1, 4]])


def test_a_cache_it_cannot_read_into_directly_gets_the_copying_path():
    """A cache that is not one contiguous host tensor (as a device cache is not) is filled by reading the
    file to host memory and copying per layer: the same result."""
    src = _cache(7)
    blocks = make_connector("shm").send("r", src, [3, 8, 1], 12)
    wide = torch.zeros(SHAPE[:2] + (SHAPE[2] + 5,) + SHAPE[3:])
    view = wide[:, :, : SHAPE[2]]
    assert not view.is_contiguous()
    try:
        make_connector("shm").receive(blocks, view, [2, 9], first=1)
    finally:
        unstage(blocks.path)
    assert torch.equal(view[:, :, [2, 9]], src[:, :, [8, 1]])
    assert wide[:, :, [0, 1, 3, 4, 5, 6, 7, 8]].abs().sum() == 0 and wide[:, :, SHAPE[2] :].abs().sum() == 0


def test_layout_mismatch_and_bad_files_are_refused():
    src = _cache(4)
    blocks = make_connector("shm").send("r", src, [1, 4], 8)
    dst = _cache(5)
    before = dst.clone()
    try:
        with pytest.raises(ValueError, match="layout"):
            make_connector("shm").receive(blocks, dst[:2].contiguous(), [6, 0])  # 2 layers, not 3
        with pytest.raises(ValueError, match="layout"):
            make_connector("shm").receive(blocks, dst.to(torch.bfloat16), [6, 0])
        with pytest.raises(ValueError, match="blocks to fill"):
            make_connector("shm").receive(blocks, dst, [6])
        with open(blocks.path, "ab") as f:  # a file of the wrong size
            f.write(b"x")
        with pytest.raises(ValueError, match="bytes"):
            make_connector("shm").receive(blocks, dst, [6, 0])
    finally:
        unstage(blocks.path)
    with pytest.raises(ValueError, match="gone"):  # removed before the engine read it
        make_connector("shm").receive(blocks, dst, [6, 0])
    import msgspec

    for path in ("/etc/passwd", os.path.join(SHM_DIR, "other-file")):
        with pytest.raises(ValueError, match="not a staged KV file"):
            make_connector("shm").receive(msgspec.structs.replace(blocks, path=path), dst, [6, 0])
    assert torch.equal(dst, before)


def test_stage_refuses_chunks_of_the_wrong_size_and_leaves_no_file():
    layout = KVLayout.of(_cache(6))
    mine = f"{PREFIX}{os.getpid()}-"  # this process's files (another pytest worker may stage meanwhile)
    listing = {f for f in os.listdir(SHM_DIR) if f.startswith(mine)}
    with pytest.raises(ValueError, match="bytes"):
        stage(layout, 2, 8, [b"\0" * (2 * layout.block_bytes() - 4)])
    assert {f for f in os.listdir(SHM_DIR) if f.startswith(mine)} <= listing


def test_sweep_removes_the_files_of_dead_writers_only():
    """A decode replica that died mid-transfer leaves its staged file; the next one to start removes it,
    never a live writer's."""
    import subprocess

    proc = subprocess.Popen(["true"])  # its pid, once reaped, is no live writer's
    proc.wait()
    orphan = os.path.join(SHM_DIR, f"{PREFIX}{proc.pid}-test")
    open(orphan, "wb").close()
    mine = make_connector("shm").send("r", _cache(8), [1], 4)
    try:
        sweep_orphans()  # (a decode replica starting in another pytest worker may sweep it first)
        assert not os.path.exists(orphan) and os.path.exists(mine.path)
    finally:
        unstage(orphan)
        unstage(mine.path)


def test_a_staging_whose_waiter_is_cancelled_leaves_no_file(monkeypatch):
    """The decode replica stages a handoff's chunks in a worker thread; if its request is cancelled
    meanwhile (client gone, ingress timeout) the thread still writes the file, which must then go too."""
    import asyncio
    import threading
    import types

    from api.cluster.disaggregated import handoff

    sent = HostCopyConnector(False).send("r", _cache(9), [1, 2], 8)
    meta = types.SimpleNamespace(layout=sent.layout, num_blocks=sent.num_blocks, num_tokens=sent.num_tokens)
    release, real_stage = threading.Event(), handoff.stage

    def slow_stage(*args):
        release.wait(10)
        return real_stage(*args)

    async def chunks(refs, timeout):
        return [memoryview(c) for c in sent.chunks]

    monkeypatch.setattr(handoff.ray_api, "get", chunks)
    monkeypatch.setattr(handoff, "decode_state", lambda b: types.SimpleNamespace())
    monkeypatch.setattr(handoff, "_blocks", types.SimpleNamespace(decode=lambda b: meta))
    monkeypatch.setattr(handoff, "stage", slow_stage)
    mine = f"{PREFIX}{os.getpid()}-"
    before = {f for f in os.listdir(SHM_DIR) if f.startswith(mine)}
    h = handoff.Handoff("r", b"", b"", [], sent.nbytes, 0.0)

    async def main():
        task = asyncio.ensure_future(handoff.from_object_store(h, 5.0, None, staging="shm"))
        await asyncio.sleep(0.05)
        task.cancel()
        release.set()  # the thread writes the file after its waiter is gone
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the thread's done-callback runs on this loop
            await asyncio.sleep(0.02)
            if {f for f in os.listdir(SHM_DIR) if f.startswith(mine)} <= before:
                return True
        return False

    assert asyncio.run(main()), "the cancelled staging's file stayed in /dev/shm"
