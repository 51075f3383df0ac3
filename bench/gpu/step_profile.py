"""Where a decode step's time goes (GPU, or CPU with `--device cpu`): torch.profiler over mixed-adapter
and base decode steps.

Builds the offline benchmark's random Llama (``--size``, as in ``bench.gpu.e2e``), queues ``--requests``
requests (request i on adapter i mod ``--adapters``), runs through prefill, then profiles ``--steps``
decode steps with CPU and CUDA activity. Prints, per run (mixed, base): wall time per step, GPU busy time
per step (sum of kernel times) and the top host-side ops by self CPU time — the gap between wall and GPU
time is host (Python/launch) overhead.

Usage: ``python -m bench.gpu.step_profile [--size 1b] [--requests 64] [--steps 10]`` (CUDA), or
``python -m bench.gpu.step_profile --device cpu --size bench --dtype float32 --requests 32 --steps 20``
(``--no-fused``: the CPU's small ops as the unfused torch formulas, `engine/model/cpu_fused.py`;
``--cpu-attention torch``: decode attention through the torch gather + SDPA path instead of the native
kernel).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common.workload import make_prompts
from bench.gpu.e2e import DTYPES, SIZES, _llm, build_adapters, build_base_on_device


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_decode(eng, prompts, params, loras, steps: int, label: str, device: str = "cuda") -> None:
    """Prefill all requests, warm up three decode steps, then profile `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for i, p in enumerate(prompts):
        eng.add_request(f"{label}-{i}", p, params, loras[i] if loras else None)
    while eng.runner.last_batch[0] != eng.runner.last_batch[1] or eng.runner.last_batch[0] == 0:
        eng.step()  # until a pure decode step ran
    for _ in range(3):
        eng.step()
    _sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync(device)
        wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    if device == "cuda":
        gpu_us = sum(e.self_device_time_total for e in events) / steps
        launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / steps
        print(f"\n### {label}: {wall * 1e3:.2f} ms per decode step (wall), GPU busy {gpu_us / 1e3:.2f} ms, "
              f"{launches:.0f} kernels per step\n")  # fmt: skip
    else:
        ops_ms = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        calls = sum(e.count for e in events) / steps  # every recorded op, nested ones included
        print(f"\n### {label}: {wall * 1e3:.2f} ms per decode step (wall, profiled), {ops_ms:.2f} ms in ops, "
              f"{calls:.0f} op calls per step")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    while eng.has_unfinished_requests():
        eng.step()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/loraplex-gpu-e2e"))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--no-fused",
        action="store_true",
        help="CPU: the torch formulas instead of the fused native small ops",
    )
    ap.add_argument(
        "--cpu-attention", choices=["native", "torch"], default="native",
        help="CPU decode attention: the native paged kernel, or the torch gather + SDPA path",
    )  # fmt: skip
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu to profile on the CPU")
        return 2
    from engine import LoRARequest, SamplingParams

    spec = SIZES[args.size]
    root = args.workdir / f"model-{args.size}-{args.dtype}"
    base = build_base_on_device(root, spec, DTYPES[args.dtype])
    dirs = build_adapters(root, spec, args.adapters, 16)
    llm = _llm(base, args.device, args.dtype, args.requests, args.prompt_len, args.adapters, 16, kv_gib=8)
    eng = llm.engine
    eng.model.fused_cpu_ops = not args.no_fused
    native = getattr(eng.runner.backend, "native", None)  # the torch backend's native CPU attention
    if native is not None:
        native.enabled = args.cpu_attention == "native"
    loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]
    for lr in loras:
        eng.pin_lora(eng.add_lora(lr))
    prompts = make_prompts(args.requests, args.prompt_len, spec.vocab_size)
    params = SamplingParams(max_tokens=args.steps + 40, temperature=0.0, ignore_eos=True)
    per_req = [loras[i % args.adapters] for i in range(args.requests)]
    profile_decode(eng, prompts, params, per_req, args.steps, "mixed", args.device)
    profile_decode(eng, prompts, params, None, args.steps, "base", args.device)
    eng.lora.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
