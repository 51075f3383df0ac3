"""Each CPU benchmark runs at a tiny size and returns sane results (no timing assertions)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.common import history
from bench.common.plots import plot_cold_load, plot_offline, plot_scaling
from bench.common.workload import LoRAOptions
from bench.gpu.e2e import SIZES
from bench.kernels.lora_cpu import run_kernels_cpu
from bench.offline.cold_load import run_cold_load
from bench.offline.scaling import run_scaling
from bench.offline.throughput import run_offline

pytestmark = pytest.mark.slow  # benchmark runs

TINY = SIZES["tiny"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


def _tiny_offline(workdir, **kwargs):
    """Benchmark 1 on the tiny model, one repeat; `kwargs` override the sizes and options."""
    sizes = {"adapters": 3, "requests": 4, "rank": 8, "prompt_len": 8, "new_tokens": 4}
    return run_offline(**(sizes | kwargs), repeats=1, gemm_repeats=1, spec=TINY, workdir=workdir, quiet=True)


def test_offline_tiny(workdir, tmp_path):
    r = _tiny_offline(workdir)
    assert r.mixed.output_tokens == r.base.output_tokens == 4 * 4
    assert r.mixed.decode_steps == r.base.decode_steps == 3 and r.base.decode_batches == [4, 4, 4]
    assert r.hf_token_match == 1.0  # same greedy tokens as HF PEFT on the same mixed batch
    assert r.mixed.token_ids != r.base.token_ids
    assert r.lora_overhead > 0 and r.speedup_vs_hf > 0 and r.gemm_fraction > 0
    assert "GEMM limit" in r.markdown()
    # byte floor: 3 distinct rank-8 adapters on all 7 projections; their pages are read on top of the base
    assert r.floor.adapter_bytes > 0 and r.floor.base_bytes > 0 and r.floor.read_gb_s > 0
    assert r.floor.lora_overhead > 1 and "the byte floor" in r.markdown()
    plot_offline(r, tmp_path / "offline.png")
    assert (tmp_path / "offline.png").stat().st_size > 0


@pytest.mark.parametrize(("backend", "lora_dtype"), [("torch", "auto"), ("native", "float16")])
def test_offline_lora_options(workdir, backend, lora_dtype):
    """`--lora-backend` / `--lora-dtype` reach the engine and are named in the result."""
    r = _tiny_offline(
        workdir, adapters=2, requests=2, new_tokens=3, hf=False, lora=LoRAOptions(backend, lora_dtype)
    )
    assert r.lora_backend == backend
    assert r.lora_dtype == ("float32" if lora_dtype == "auto" else lora_dtype)
    assert f"{backend}, {r.lora_dtype} pages" in r.markdown()


def test_offline_beside_cpu_hogs_in_bfloat16(workdir):
    """`--hog N` runs each repeat again beside N busy processes (gone afterwards), `--dtype` reaches the
    engine; both show in the result."""
    r = _tiny_offline(workdir, adapters=2, requests=2, new_tokens=3, hf=False, dtype="bfloat16", hogs=2)
    assert r.dtype == "bfloat16" and r.lora_dtype == "bfloat16" and r.lora_backend == "native"
    assert r.hog_mixed.output_tokens == r.mixed.output_tokens == 6
    assert r.hog_mixed.token_ids == r.mixed.token_ids  # same work, only slower
    mixed_kept, base_kept = r.hog_retained
    assert 0 < mixed_kept < 10 and 0 < base_kept < 10
    assert "beside 2 busy processes" in r.markdown() and len(r.load_avg) == 2


def test_cpu_hogs_are_busy_and_gone_afterwards():
    import time

    from bench.common.hog import cpu_hogs

    with cpu_hogs(2) as pids:
        time.sleep(0.5)
        ticks = [int(Path(f"/proc/{pid}/stat").read_text().split()[13]) for pid in pids]  # utime
        assert all(t > 0 for t in ticks)  # spinning, not sleeping
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    with pytest.raises(ValueError, match="hog count"), cpu_hogs(-1):
        pass


def test_history_chart_from_the_docs_record(tmp_path):
    """The milestone chart in docs/ is drawn from docs/bench_history.json."""
    record = Path(__file__).resolve().parents[2] / "docs" / "bench_history.json"
    assert len(json.loads(record.read_text())["points"]) >= 2
    history.main([str(record), str(tmp_path / "history.png")])
    assert (tmp_path / "history.png").read_bytes()[:4] == b"\x89PNG"


def test_scaling_tiny(workdir, tmp_path):
    r = run_scaling(
        counts=(1, 4, 12),
        pool_pages=16,
        batch=4,
        prompt_len=8,
        new_tokens=3,
        spec=TINY,
        workdir=workdir,
        quiet=True,
        repeats=2,
        thrash_adapters=12,
        thrash_per_adapter=2,
    )
    assert [p.adapters for p in r.points] == [1, 4, 12]
    runs = [p.run for p in r.points]
    assert [p.requests for p in runs] == [4, 4, 12]
    assert all(p.output_tokens == 3 * p.requests for p in runs)
    assert runs[0].pool_hit_rate == 1.0  # one adapter, warmed up: always resident
    assert runs[-1].pool_hit_rate < 1.0  # 12 adapters of up to 4 pages do not fit 16 pages
    assert all(0.0 <= p.pool_hit_rate <= 1.0 for p in runs)
    assert r.drop_vs_first()[0] == 0.0
    # the byte floor counts every step: base bytes each, adapter pages for the adapters in it
    assert runs[0].mean_distinct_adapters == 1.0 and runs[-1].mean_distinct_adapters > 1.0
    assert all(p.steps >= 3 and p.floor_s > 0 for p in runs)
    assert [(t.order, t.resident_first) for t in r.thrash] == [
        ("cyclic", True),
        ("cyclic", False),
        ("random", True),
        ("random", False),
    ]
    assert all(t.run.requests == 24 and t.run.output_tokens == 72 for t in r.thrash)
    assert "resident-first" in r.markdown() and "decode floor" in r.markdown()
    plot_scaling(r, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_cold_load_tiny(workdir, tmp_path):
    r = run_cold_load(
        batch=4,
        rank=16,
        prompt_len=8,
        new_tokens=12,
        inject_after=3,
        repeats=1,
        spec=TINY,
        workdir=workdir,
        quiet=True,
    )
    assert [run.cold for run in r.runs] == [False, True]
    for run in r.runs:
        assert run.window_steps >= 1 and run.ttft_s > 0 and run.baseline_step_s > 0
    assert math.isfinite(r.load_cost_steps)
    plot_cold_load(r, tmp_path / "cold.png")


def test_kernels_cpu_tiny():
    """Every CPU LoRA path on a tiny shape: same outputs as the float32 torch path, sane timings."""
    from kernels.lora_bgmv_cpu import available_isas, best_isa

    if "avx2" not in available_isas():
        pytest.skip("the avx2 kernel level does not run on this CPU")
    r = run_kernels_cpu(adapters=3, rows=5, threads=(1, 2), repeats=1, spec=TINY)
    assert len(r.timings) == 2 * 7 * 2  # steps x paths (4 float32-activation, 3 bfloat16) x thread counts
    for t in r.timings:
        assert t.ms > 0
        tol = 1e-5 if t.dtype == "float32" else 5e-3 if t.dtype.endswith("16") else 2e-2  # rounded pages / y
        assert t.max_abs_diff <= tol, t
    decode = [t for t in r.timings if t.step == "decode"]
    assert all(t.page_bytes > 0 and t.gb_per_s > 0 for t in decode)
    assert {t.path for t in decode} == {"torch", f"native {best_isa()}", "native avx2"}
    native = {t.dtype: t for t in decode if t.path.startswith("native")}
    f32, f16 = native["float32"], native["float16"]
    assert f16.page_bytes * 2 == f32.page_bytes
    assert all(g > 0 for g in r.read_gb_per_s.values()) and "torch.sum" in r.markdown()


def test_gpu_e2e_script_on_cpu(tmp_path):
    """`bench.gpu.e2e` (run by bench/gpu/check.sh on a GPU) works end to end at a tiny size on CPU: the
    parity part agrees with HF + PEFT, and the throughput part times both runs on the same batch."""
    from bench.gpu import e2e

    out = tmp_path / "e2e.json"
    sizes = ["--size", "tiny", "--parity-size", "tiny", "--dtype", "float32", "--requests", "4"]
    runs = ["--adapters", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1"]
    argv = ["--device", "cpu", *sizes, *runs, "--parity-adapters", "2", "--workdir", str(tmp_path)]
    assert e2e.main([*argv, "--kv-gib", "0.05", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["parity"]["token_match"] == 1.0 and result["parity"]["base_match"] == 1.0
    tp = result["throughput"]
    assert tp["mixed"]["output_tokens"] == tp["base"]["output_tokens"] == 4 * 4
    assert tp["mixed"]["decode_steps"] == 3 and tp["lora_overhead"] > 0


def test_decode_profile_script_on_cpu(tmp_path, capsys):
    """`bench.gpu.step_profile --device cpu` profiles mixed and base decode steps at a tiny size: both
    reports, with the matrix products among the ops."""
    from bench.gpu import step_profile

    argv = ["--device", "cpu", "--size", "tiny", "--dtype", "float32", "--requests", "4", "--adapters", "2"]
    assert step_profile.main([*argv, "--steps", "2", "--prompt-len", "8", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "### mixed:" in out and "### base:" in out
    assert "mkldnn::_linear_pointwise" in out or "aten::mm" in out  # packed weights (CPU float32), or dense


def test_decode_profile_counts_fewer_ops_with_the_fused_cpu_ops(tmp_path, capsys):
    """`--no-fused` profiles the torch formulas for the small ops: more op calls per step than fused."""
    import re

    from bench.gpu import step_profile

    argv = ["--device", "cpu", "--size", "tiny", "--requests", "2", "--adapters", "1", "--steps", "2"]
    calls = []
    for extra in ([], ["--no-fused"]):
        assert step_profile.main([*argv, "--prompt-len", "8", "--workdir", str(tmp_path), *extra]) == 0
        base = capsys.readouterr().out.split("### base:")[1]
        calls.append(int(re.search(r"(\d+) op calls per step", base).group(1)))
    assert calls[0] < calls[1]


def test_offline_compares_the_unfused_small_ops(workdir):
    """`--compare-unfused`: an interleaved base-only leg with the torch formulas, same greedy tokens."""
    r = _tiny_offline(workdir, adapters=2, requests=2, new_tokens=3, hf=False, compare_unfused=True)
    assert r.base_unfused is not None and r.base_unfused.token_ids == r.base.token_ids
    assert "unfused small ops" in r.markdown() and "greedy tokens equal: True" in r.markdown()
    assert "base_unfused" in r.to_dict()


def test_fused_ops_script(capsys):
    """`bench.kernels.fused_cpu`: each way per op group with its ratio; `--steps`: the alternating step
    A/B."""
    from bench.kernels import fused_cpu

    assert fused_cpu.main(["--tokens", "3", "--repeats", "1", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("torch, unfused") == 3 and "native silu_mul" in out
    assert fused_cpu.main(["--tokens", "2", "--steps", "4"]) == 0
    assert "ms fused" in capsys.readouterr().out


def test_cpu_attention_ab_script(tmp_path, capsys):
    """`bench.kernels.cpu_attention` times the native and the torch CPU attention paths at a tiny size, and
    both paths generate the same greedy tokens; `bench.gpu.step_profile --cpu-attention torch` runs the
    torch path."""
    from bench.gpu import step_profile
    from bench.kernels import cpu_attention

    argv = ["--size", "tiny", "--requests", "4", "--prompt-len", "8", "--steps", "2"]
    argv += ["--workdir", str(tmp_path)]
    assert cpu_attention.main([*argv, "--new-tokens", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention alone" in out and "decode step" in out and "greedy equal 4/4" in out
    argv += ["--device", "cpu", "--dtype", "float32", "--adapters", "2", "--cpu-attention", "torch"]
    assert step_profile.main(argv) == 0
    assert "aten::_scaled_dot_product" in capsys.readouterr().out  # the torch path's SDPA ran


def test_peer_workload_is_what_both_engines_read(tmp_path):
    """The vLLM peer benchmark's workload (no vLLM needed): model, PEFT adapters and token-id prompts on
    disk, the runner's spec file, and the environment vLLM CPU is started with."""
    from bench.peer.offline import RUNNER, build_workload, vllm_env

    wl = build_workload(tmp_path, adapters=3, requests=5, rank=8, prompt_len=7, new_tokens=4, spec=TINY)
    assert (Path(wl.model) / "config.json").exists() and len(wl.adapters) == 3
    for d in wl.adapters:
        config = json.loads((Path(d) / "adapter_config.json").read_text())
        assert config["r"] == 8 and len(config["target_modules"]) == 7
        assert (Path(d) / "adapter_model.safetensors").stat().st_size > 0
    assert len(wl.prompts) == 5 and {len(p) for p in wl.prompts} == {7}
    assert all(3 <= t < TINY.vocab_size for p in wl.prompts for t in p)
    again = build_workload(tmp_path, adapters=3, requests=5, rank=8, prompt_len=7, new_tokens=4, spec=TINY)
    assert again.prompts == wl.prompts  # seeded: both engines, every run, the same prompts
    spec = json.loads(wl.spec_file(tmp_path / "s.json", enable_lora=True).read_text())
    assert spec["enable_lora"] and spec["new_tokens"] == 4 and spec["max_lora_rank"] == 16
    assert spec["prompts"] == wl.prompts and spec["dtype"] == "float32"
    env = vllm_env(tmp_path / "venv" / "bin" / "python", threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert RUNNER.exists() and "loraplex" not in RUNNER.read_text().split('"""')[2]  # no loraplex imports
    with pytest.raises(ValueError, match=">= 1"):
        build_workload(tmp_path, adapters=0, spec=TINY)
