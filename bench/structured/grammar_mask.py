"""Per-token cost of grammar-constrained decoding on CPU: llguidance vs xgrammar vs outlines-core.

For each library: compile a realistic JSON schema against a ~32k-token byte-level BPE vocabulary (trained
here on local text, nothing downloaded), then replay a valid document token by token, timing for every
token the computation of the allowed-token bitmask (into a preallocated int32 array, as the engine does)
and the advance of the matcher by that token. Libraries that are not installed are skipped.

    python -m bench.structured.grammar_mask [--vocab 32000] [--repeats 3] [--json out.json] [--engine]

`--engine` also times loraplex's engine end to end on a small random llama with that tokenizer: decode
throughput of a batch of sequences constrained by the schema vs the same batch unconstrained.

Results: compile time (tokenizer set-up separately: it is once per model), mean and p99 mask time per
token, mean advance time per token. The machine is noisy: compare the libraries within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "ticket_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "category": {"type": "string", "enum": ["billing", "shipping", "returns", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 60},
                "email": {"type": "string", "maxLength": 80},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 20},
                    "quantity": {"type": "integer", "minimum": 0},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "summary": {"type": "string", "maxLength": 400},
    },
    "required": ["ticket_id", "category", "priority", "customer", "items", "summary"],
    "additionalProperties": False,
}

DOCUMENT = {
    "ticket_id": "ORD-4821",
    "category": "shipping",
    "priority": 3,
    "customer": {"name": "Dana Whitfield", "email": "dana.whitfield@example.com", "vip": False},
    "items": [
        {"sku": "LAMP-0042-BLK", "quantity": 2, "price": 39.5},
        {"sku": "CABLE-USB-C-2M", "quantity": 1, "price": 12.99},
    ],
    "summary": (
        "The customer reports that the second parcel of order ORD-4821 has not arrived although the "
        "tracking page says it was delivered on Tuesday. She asks for a replacement lamp or a refund, "
        "and would like an update by email before the weekend."
    ),
}

# (item separator, key separator) tried in order until a library accepts the whole document
SEPARATORS = ((",", ":"), (", ", ": "))


@dataclass(slots=True)
class LibResult:
    library: str
    version: str
    tokenizer_setup_ms: float
    compile_ms: float
    tokens: int
    mask_mean_us: float
    mask_p99_us: float
    advance_mean_us: float
    separators: str


def build_tokenizer(vocab: int, cache: Path):
    """A byte-level BPE `PreTrainedTokenizerFast` of about `vocab` tokens trained on this Python
    installation's own source files (cached in `cache`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = cache / f"bpe-{vocab}.json"
    if not path.exists():
        files = sorted(str(p) for p in Path(np.__file__).parents[1].rglob("*.py"))[:3000]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train(files, trainer)
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _replay(
    ids: list[int], fill: Callable[[], None], advance: Callable[[int], bool], allowed: Callable[[int], bool]
) -> tuple[list[float], list[float]] | None:
    """Time fill+advance for each token; None if a token of the document is not allowed."""
    masks, advances = [], []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        if not allowed(t):
            return None
        t2 = time.perf_counter()
        if not advance(t):
            return None
        t3 = time.perf_counter()
        masks.append(t1 - t0)
        advances.append(t3 - t2)
    return masks, advances


def _bit(mask: np.ndarray, t: int) -> bool:
    return bool((int(mask.reshape(-1)[t // 32]) >> (t % 32)) & 1)


def _summarize(lib, version, setup, compile_s, runs, sep) -> LibResult:
    masks = [m for r in runs for m in r[0]]
    advs = [a for r in runs for a in r[1]]
    return LibResult(
        lib,
        version,
        setup * 1e3,
        compile_s * 1e3,
        len(runs[0][0]),
        statistics.mean(masks) * 1e6,
        float(np.percentile(masks, 99)) * 1e6,
        statistics.mean(advs) * 1e6,
        repr(sep),
    )


def bench_llguidance(hf, repeats: int) -> LibResult | None:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    setup = time.perf_counter() - t0
    for sep in SEPARATORS:
        opts = {"item_separator": sep[0], "key_separator": sep[1], "whitespace_flexible": False}
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=opts)  # type: ignore[arg-type]
        first = llguidance.LLMatcher(tok, grammar)
        compile_s = time.perf_counter() - t0
        assert not first.is_error(), first.get_error()
        ids = hf.encode(json.dumps(DOCUMENT, separators=sep), add_special_tokens=False)
        runs = []
        for _ in range(repeats):
            m = llguidance.LLMatcher(tok, grammar)
            mask = allocate_token_bitmask(1, tok.vocab_size)
            r = _replay(
                ids, lambda m=m, mask=mask: fill_next_token_bitmask(m, mask), m.consume_token, lambda t: True
            )
            if r is None or not m.is_accepting():
                break
            runs.append(r)
        if len(runs) == repeats:
            return _summarize("llguidance", llguidance.__version__, setup, compile_s, runs, sep)
    return None


def bench_xgrammar(hf, repeats: int) -> LibResult | None:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    setup = time.perf_counter() - t0
    for sep in SEPARATORS:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=sep)
        compile_s = time.perf_counter() - t0
        ids = hf.encode(json.dumps(DOCUMENT, separators=sep), add_special_tokens=False)
        runs = []
        for _ in range(repeats):
            m = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            view = mask.numpy()
            r = _replay(
                ids,
                lambda m=m, mask=mask: m.fill_next_token_bitmask(mask),
                m.accept_token,
                lambda t, v=view: _bit(v, t),
            )
            if r is None:
                break
            runs.append(r)
        if len(runs) == repeats:
            return _summarize(
                "xgrammar", f"{_version('xgrammar')} (torch {torch.__version__})", setup, compile_s, runs, sep
            )
    return None


def bench_outlines(hf, repeats: int) -> LibResult | None:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    from engine.tokenizer import token_bytes

    t0 = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    eos = hf.eos_token_id
    for t in range(len(hf)):
        if t in hf.all_special_ids:
            continue
        vocab.setdefault(token_bytes(hf, t), []).append(t)
    voc = outlines_core.Vocabulary(eos, vocab)
    setup = time.perf_counter() - t0
    n_words = (len(hf) + 31) // 32
    for sep in SEPARATORS:
        ws = r"[ ]?" if sep[0] == ", " else r""
        t0 = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=ws)
        index = outlines_core.Index(regex, voc)
        compile_s = time.perf_counter() - t0
        ids = hf.encode(json.dumps(DOCUMENT, separators=sep), add_special_tokens=False)
        runs = []
        for _ in range(repeats):
            g = outlines_core.Guide(index)
            mask = np.zeros((1, n_words), dtype=np.int32)

            def advance(t: int, g=g) -> bool:
                g.advance(t)
                return True

            r = _replay(
                ids,
                lambda g=g, mask=mask: g.write_mask_into(mask.ctypes.data, mask.size, 4),
                advance,
                lambda t, mask=mask: _bit(mask, t),
            )
            if r is None:
                break
            runs.append(r)
        if len(runs) == repeats:
            version = _version("outlines_core")
            return _summarize("outlines-core", version, setup, compile_s, runs, sep)
    return None


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def engine_overhead(hf, cache: Path, batch: int = 16, max_tokens: int = 48, repeats: int = 5) -> dict:
    """Generated tokens per second of `batch` sampled sequences, unconstrained vs constrained by SCHEMA
    (best of `repeats`, interleaved), on a random 4-layer llama (hidden 256) with tokenizer `hf`."""
    import torch
    import transformers as tf

    from engine import LLM, SamplingParams
    from engine.structured import StructuredSpec

    model_dir = cache / f"llama-{len(hf)}"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(
            vocab_size=len(hf),
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=hf.bos_token_id,
            eos_token_id=hf.eos_token_id,
        )
        tf.LlamaForCausalLM(cfg).save_pretrained(model_dir)
        hf.save_pretrained(model_dir)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", enable_lora=False)
    prompts = [f"ticket {i}: the parcel" for i in range(batch)]
    spec = StructuredSpec.json_schema(SCHEMA)
    best = {"free": 0.0, "schema": 0.0}
    for _ in range(repeats):
        for kind in best:
            params = [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0,
                    seed=i,
                    ignore_eos=True,
                    structured=spec if kind == "schema" else None,
                )
                for i in range(batch)
            ]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best[kind] = max(best[kind], tokens / elapsed)
    return {"batch": batch, "free_tok_s": best["free"], "schema_tok_s": best["schema"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/loraplex-bench-tokenizer"))
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--engine", action="store_true", help="also time the engine, constrained vs free")
    args = ap.parse_args(argv)
    hf = build_tokenizer(args.vocab, args.cache)
    print(f"tokenizer: byte-level BPE, {len(hf)} tokens", file=sys.stderr)
    benches = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines": bench_outlines}
    results: list[LibResult] = []
    for name in args.libs.split(","):
        try:
            res = benches[name](hf, args.repeats)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})", file=sys.stderr)
            continue
        if res is None:
            print(f"{name}: did not accept the document", file=sys.stderr)
            continue
        results.append(res)
    print(
        "| library | version | tokenizer set-up ms | schema compile ms | tokens | mask mean µs | mask p99 µs "
        "| advance mean µs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.library} | {r.version} | {r.tokenizer_setup_ms:.0f} | {r.compile_ms:.1f} | {r.tokens} "
            f"| {r.mask_mean_us:.0f} | {r.mask_p99_us:.0f} | {r.advance_mean_us:.0f} |"
        )
    report: dict = {"libraries": [asdict(r) for r in results]}
    if args.engine:
        e = engine_overhead(hf, args.cache)
        report["engine"] = e
        print(f"\n| engine, batch {e['batch']} | free tok/s | json_schema tok/s | ratio |\n|---|---|---|---|")
        ratio = e["schema_tok_s"] / e["free_tok_s"]
        print(f"| 4-layer llama, 32k vocab | {e['free_tok_s']:.0f} | {e['schema_tok_s']:.0f} | {ratio:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
