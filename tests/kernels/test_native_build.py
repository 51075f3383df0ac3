"""Building the native kernel: cached per machine, retried without OpenMP, refused with a reason."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from kernels import lora_bgmv_cpu
from kernels.native_build import NativeBuildError, build_library, cache_dir
from tests.kernels.lora_case import make_case
from tests.kernels.test_lora_bgmv_cpu import DECODE_SLOTS, H_IN, H_OUTS, MIXED_RANKS, _run_both


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty build cache; the process's cached kernels are dropped before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lora_bgmv_cpu.forget_library()
    yield tmp_path
    lora_bgmv_cpu.forget_library()


def _fake_cc(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_build_is_cached_and_reused(fresh_cache, monkeypatch):
    build_library("lora_bgmv.c")
    built = sorted(cache_dir().glob("lora_bgmv-*.so"))
    assert len(built) == 1 and not list(cache_dir().glob(".*"))  # no temporary files left behind
    calls = fresh_cache / "calls"
    cc = _fake_cc(fresh_cache / "cc", f'echo "$@" >> {calls}\nexec gcc "$@"\n')
    monkeypatch.setenv("CC", cc)
    # another compiler is another key: one new build; then the cache serves it without compiling
    build_library("lora_bgmv.c")
    build_library("lora_bgmv.c")
    compiles = [ln for ln in calls.read_text().splitlines() if "-shared" in ln]
    assert len(compiles) == 1


def test_without_openmp_the_kernel_still_builds_and_is_correct(fresh_cache, monkeypatch):
    """A compiler without OpenMP: the build is retried without -fopenmp; threads then run as one."""
    body = (
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "no OpenMP here" >&2; exit 1; }; done\n'
        'exec gcc "$@"\n'
    )
    monkeypatch.setenv("CC", _fake_cc(fresh_cache / "cc", body))
    assert torch.float32 in lora_bgmv_cpu.supported_dtypes()
    case = make_case(MIXED_RANKS, DECODE_SLOTS * 2, H_IN, H_OUTS, 8, torch.float32)
    y, ref = _run_both(case, 8, num_threads=2)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_a_source_that_does_not_compile_says_why(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", _fake_cc(fresh_cache / "cc", 'echo "cc: fatal error: broken" >&2\nexit 1\n'))
    with pytest.raises(NativeBuildError, match="fatal error: broken"):
        build_library("lora_bgmv.c")
    assert not [p for p in os.listdir(cache_dir()) if p.endswith(".so")]
