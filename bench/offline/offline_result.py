"""The result of one offline throughput run (`bench/offline/throughput.py`): its timings, the ratios the
performance goals are stated in, and the table `docs/benchmarks.md` records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bench.common.workload import RunTiming
from bench.offline.byte_floor import ByteFloor


@dataclass(slots=True)
class OfflineResult:
    """Timings of one offline run and the ratios the performance goals are stated in."""

    requests: int
    adapters: int
    rank: int
    prompt_len: int
    new_tokens: int
    threads: int
    mixed: RunTiming
    base: RunTiming
    hf_peft_s: float | None = None
    hf_token_match: float | None = None  # fraction of requests whose greedy tokens equal PEFT's
    gemm_limit_decode_s: float | None = None
    spec: dict = field(default_factory=dict)
    lora_backend: str = ""  # the engine's LoRA path ("native", "torch", "triton")
    lora_dtype: str = ""  # the adapter pool's dtype
    dtype: str = "float32"  # the model's
    hogs: int = 0  # busy processes competing in the hog runs
    hog_mixed: RunTiming | None = None
    hog_base: RunTiming | None = None
    adaptive_threads: bool = True  # the engine's thread governor (engine/cpu_threads.py) was on
    floor: ByteFloor | None = None  # bytes a decode step must read, and the read bandwidth
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average at the start and the end
    base_unfused: RunTiming | None = None  # `--compare-unfused`: base-only with the torch small ops on CPU

    @property
    def lora_overhead(self) -> float:
        """Mixed-adapter time / base-only time (goal <= 1.15)."""
        return self.mixed.total_s / self.base.total_s

    @property
    def speedup_vs_hf(self) -> float | None:
        """HF PEFT time / loraplex mixed time on the same batch (goal >= 5)."""
        return None if self.hf_peft_s is None else self.hf_peft_s / self.mixed.total_s

    @property
    def gemm_fraction(self) -> float | None:
        """GEMM-limit time / base decode time over the same decode steps (goal >= 0.6)."""
        return None if self.gemm_limit_decode_s is None else self.gemm_limit_decode_s / self.base.decode_s

    @property
    def hog_retained(self) -> tuple[float, float] | None:
        """Throughput under the hogs / quiet throughput, (mixed, base) (goal >= 1/3)."""
        if self.hog_mixed is None or self.hog_base is None:
            return None
        return self.mixed.total_s / self.hog_mixed.total_s, self.base.total_s / self.hog_base.total_s

    def to_dict(self) -> dict:
        d = asdict(self)
        for run in ("mixed", "base", "hog_mixed", "hog_base", "base_unfused"):
            if d[run] is not None:
                d[run].pop("token_ids")
        d.update(
            lora_overhead=self.lora_overhead,
            speedup_vs_hf=self.speedup_vs_hf,
            gemm_fraction=self.gemm_fraction,
            hog_retained=self.hog_retained,
        )
        return d

    def markdown(self) -> str:
        """The result as the table `docs/benchmarks.md` records."""
        tok = self.mixed.output_tokens
        lines = [
            "| run | total (s) | prefill (s) | decode (s) | output tok/s |",
            "|---|---|---|---|---|",
            f"| loraplex {self.dtype}, {self.adapters} adapters (rank {self.rank}, all 7 projections; "
            f"{self.lora_backend}, {self.lora_dtype} pages) | "
            f"{self.mixed.total_s:.2f} | {self.mixed.prefill_s:.2f} | {self.mixed.decode_s:.2f} | "
            f"{self.mixed.tokens_per_s:.0f} |",
            f"| loraplex, base model only | {self.base.total_s:.2f} | {self.base.prefill_s:.2f} | "
            f"{self.base.decode_s:.2f} | {self.base.tokens_per_s:.0f} |",
        ]
        if self.base_unfused is not None:
            u = self.base_unfused
            lines.append(
                f"| loraplex, base model only, unfused small ops | {u.total_s:.2f} | {u.prefill_s:.2f} | "
                f"{u.decode_s:.2f} | {u.tokens_per_s:.0f} |"
            )
        for name, run in (("adapters", self.hog_mixed), ("base model only", self.hog_base)):
            if run is not None:
                lines.append(
                    f"| loraplex, {name}, beside {self.hogs} busy processes | {run.total_s:.2f} | "
                    f"{run.prefill_s:.2f} | {run.decode_s:.2f} | {run.tokens_per_s:.0f} |"
                )
        if self.hf_peft_s is not None:
            hf_tps = tok / self.hf_peft_s
            lines.append(f"| HF transformers + PEFT, mixed batch | {self.hf_peft_s:.2f} | | | {hf_tps:.0f} |")
        if self.gemm_limit_decode_s is not None:
            n = self.base.decode_steps
            lines.append(f"| GEMM limit ({n} decode steps) | | | {self.gemm_limit_decode_s:.2f} | |")
        lines.append("")
        lines.append(f"- LoRA overhead (mixed / base time): **{self.lora_overhead:.2f}x**")
        if self.base_unfused is not None:
            u, b = self.base_unfused, self.base
            lines.append(
                f"- Fused CPU small ops, base only: **{u.total_s / b.total_s:.2f}x** the unfused throughput "
                f"(decode {u.decode_s / b.decode_s:.2f}x); greedy tokens equal: {u.token_ids == b.token_ids}"
            )
        if self.hog_retained is not None:
            m, b = self.hog_retained
            lines.append(
                f"- Beside {self.hogs} busy processes: **{m:.2f}x** (adapters) and **{b:.2f}x** (base) of "
                f"the quiet throughput (goal >= 0.33x); {self.threads} threads, "
                f"{'adaptive' if self.adaptive_threads else 'fixed'}"
            )
        if self.floor is not None and self.mixed.decode_steps and self.base.decode_steps:
            f = self.floor
            mixed_step = self.mixed.decode_s / self.mixed.decode_steps
            base_step = self.base.decode_s / self.base.decode_steps
            lines.append(
                f"- Decode step: {mixed_step * 1e3:.1f} ms mixed, {base_step * 1e3:.1f} ms base: overhead "
                f"**{mixed_step / base_step:.2f}x** vs the byte floor {f.lora_overhead:.2f}x "
                f"({f.base_bytes / 1e6:.0f} MB base + {f.adapter_bytes / 1e6:.0f} MB adapter pages at "
                f"{f.read_gb_s:.1f} GB/s: {f.step_s(True) * 1e3:.1f} / {f.step_s(False) * 1e3:.1f} ms); "
                f"**{mixed_step / base_step / f.lora_overhead:.2f}x** the floor"
            )
            lora_s, lora_floor = mixed_step - base_step, f.adapter_bytes / (f.read_gb_s * 1e9)
            lines.append(
                f"- LoRA time per decode step: {lora_s * 1e3:.1f} ms vs reading the adapter bytes at that "
                f"bandwidth {lora_floor * 1e3:.1f} ms: **{lora_s / lora_floor:.2f}x**"
            )
        if self.load_avg:
            lines.append(
                f"- Load average (1 min) at start / end: {' / '.join(f'{x:.1f}' for x in self.load_avg)}"
            )
        if self.speedup_vs_hf is not None:
            lines.append(
                f"- Speed-up over HF PEFT mixed-batch generate: **{self.speedup_vs_hf:.1f}x** (goal >= 5x); "
                f"greedy tokens equal to PEFT's for {self.hf_token_match:.0%} of requests"
            )
        if self.gemm_fraction is not None:
            lines.append(f"- Base decode at **{self.gemm_fraction:.0%}** of the GEMM limit (goal >= 60%)")
        return "\n".join(lines)
