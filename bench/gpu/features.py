"""The engine's newer features on a CUDA device, with the bundled demo model (``--help`` works anywhere).

Each check prints one row of a markdown table and the script exits non-zero when any fails:

1. **demo outputs** — greedy completions of the four demo adapters and the base model in one mixed batch
   equal what each computes in Python (`demo/README.md`: echo, upper, reverse, rot13, no vowels).
2. **speculative = plain** — the same batch with the n-gram proposer (k=4) gives the same greedy tokens.
3. **structured output** — a JSON-schema constrained request per adapter (sampled, seeded) parses and has
   the required keys with the right types; the grammar masks run beside a CUDA model.
4. **seeded sampling repeats** — `n=3`, temperature 1, one seed: two runs give the same choices.

Usage: ``python -m bench.gpu.features [--device cuda] [--dtype float32]``; `bench/gpu/check.sh` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.train_demo import DEMO_OUTPUTS

DEMO = Path(__file__).resolve().parents[2] / "demo"
WORDS = ["hello world", "abc", "quick brown fox", "zebra", "lorem ipsum", "gpu check"]
SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0}},
    "required": ["word", "n"],
    "additionalProperties": False,
}


def _batch(words: int = len(WORDS)) -> tuple[list[str], list[str | None]]:
    """Every (prompt, adapter) pair of the first `words` WORDS x DEMO_OUTPUTS, adapters interleaved."""
    prompts, names = [], []
    for w in WORDS[:words]:
        for name in DEMO_OUTPUTS:
            prompts.append(f"{w}=")
            names.append(name)
    return prompts, names


def _valid(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("word"), str) and isinstance(doc.get("n"), int)


def run(device: str, dtype: str, words: int = len(WORDS)) -> list[tuple[str, str, bool]]:
    """(check, detail, passed) per check (module docstring), over the first `words` WORDS."""
    from engine import LLM, LoRARequest, SamplingParams
    from engine.structured import StructuredSpec

    prompts, names = _batch(words)
    loras = {n: LoRARequest(n, str(DEMO / "adapters" / n)) for n in DEMO_OUTPUTS if n is not None}
    per_req = [loras[n] if n else None for n in names]
    greedy = SamplingParams(max_tokens=32, temperature=0, stop=["\n"])
    rows: list[tuple[str, str, bool]] = []

    llm = LLM(str(DEMO / "base"), device=device, dtype=dtype, max_loras=4)
    outs = [o.outputs[0] for o in llm.generate(prompts, greedy, lora_request=per_req)]
    ok = sum(o.text == DEMO_OUTPUTS[n](p[:-1]) for o, n, p in zip(outs, names, prompts, strict=True))
    rows.append(("demo outputs", f"{ok}/{len(prompts)} equal the Python transform", ok == len(prompts)))

    structured = SamplingParams(
        max_tokens=64, temperature=1.0, seed=11, structured=StructuredSpec.json_schema(SCHEMA)
    )
    s_outs = [o.outputs[0].text for o in llm.generate(prompts, structured, lora_request=per_req)]
    ok = sum(_valid(t) for t in s_outs)
    detail = f"{ok}/{len(s_outs)} valid JSON with the schema's keys"
    rows.append(("structured output", detail, ok == len(s_outs)))

    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=3)
    runs = [
        [c.token_ids for o in llm.generate(prompts, sampled, lora_request=per_req) for c in o.outputs]
        for _ in range(2)
    ]
    rows.append(("seeded sampling repeats", f"{len(runs[0])} choices, n=3", runs[0] == runs[1]))
    llm.engine.lora.shutdown()
    del llm

    spec = LLM(str(DEMO / "base"), device=device, dtype=dtype, max_loras=4, speculative="ngram")
    s = [o.outputs[0] for o in spec.generate(prompts, greedy, lora_request=per_req)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs, s, strict=True))
    rows.append(("speculative = plain", f"{same}/{len(prompts)} greedy outputs equal", same == len(prompts)))
    spec.engine.lora.shutdown()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    words = f"prompt words per adapter, 1..{len(WORDS)} (fewer: a quicker smoke test)"
    p.add_argument(
        "--words", type=int, default=len(WORDS), choices=range(1, len(WORDS) + 1), metavar="N", help=words
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("bench/gpu/features.py needs a CUDA device (--device cpu smoke-tests the script itself)")
            return 2
    rows = run(args.device, args.dtype, args.words)
    print(f"| check ({args.device}, {args.dtype}) | result | pass |\n|---|---|---|")
    for name, detail, passed in rows:
        print(f"| {name} | {detail} | {'yes' if passed else 'NO'} |")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
