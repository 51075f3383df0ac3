"""The vLLM side of `bench.peer.offline`, run by the vLLM virtualenv's Python (imports nothing of loraplex).

    <vllm-venv>/bin/python bench/peer/vllm_runner.py SPEC.json

SPEC.json: {"model": dir, "adapters": [dir, ...], "prompts": [[ids]], "new_tokens": n, "dtype": "float32",
"enable_lora": bool, "max_lora_rank": r, "expert_adapters": [dir, ...] (optional)}. It builds one `vllm.LLM`
(token-id prompts, no tokenizer), says `PEER {"ready": seconds}` on stdout, then answers one command per
stdin line, `mixed` (request i on adapter i mod N), `experts` (the same over `expert_adapters`) or `base`,
with `PEER {"seconds": s, "tokens": [[ids]]}`, or `PEER {"error": message}` when vLLM refuses the batch
(an adapter it cannot load); `quit` (or end of input) stops it. Timings cover `generate` only; greedy,
`ignore_eos`, all requests in one call.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    kwargs = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        max_num_seqs=max(len(spec["prompts"]), 1),
        max_model_len=max(len(p) for p in spec["prompts"]) + spec["new_tokens"] + 16,
        seed=0,
    )
    if spec["enable_lora"]:
        kwargs.update(
            enable_lora=True,
            max_loras=max(len(spec["adapters"]), len(spec.get("expert_adapters", [])), 1),
            max_lora_rank=spec["max_lora_rank"],
        )
    llm = LLM(**kwargs)
    say({"ready": time.perf_counter() - t0})
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    sets = {"mixed": spec["adapters"], "experts": spec.get("expert_adapters", [])}
    loras = {k: [LoRARequest(f"{k}{i}", len(sets["mixed"]) * (k == "experts") + i + 1, d) for i, d in
                 enumerate(dirs)] for k, dirs in sets.items()}  # fmt: skip
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        per_req = None
        if cmd in loras:
            per_req = [loras[cmd][i % len(loras[cmd])] for i in range(len(prompts))]
        t = time.perf_counter()
        try:
            outs = llm.generate(prompts, params, lora_request=per_req, use_tqdm=False)
        except Exception as e:  # vLLM's refusal is the answer
            say({"error": f"{type(e).__name__}: {e}"})
            continue
        seconds = time.perf_counter() - t
        say({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})


def say(obj: dict) -> None:
    print("PEER " + json.dumps(obj), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
