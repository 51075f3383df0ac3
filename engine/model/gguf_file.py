"""A llama.cpp GGUF checkpoint as the engine sees it: where the file is, and the architecture facts its
metadata states, as the fields of a Hugging Face `config.json`.

`model` may be a `.gguf` file, or a directory that holds exactly one `.gguf` file and no `config.json`
(a directory with a `config.json` is a Hugging Face checkpoint, whatever else it holds). The weights
themselves are read by `engine.model.gguf_loader`.

Supported: `general.architecture` `llama` (also Mistral-family and Mixtral files, which llama.cpp calls
llama), `qwen2`, `granite`, `phi3`, `gemma2`, `gemma3` and the mixture-of-experts `qwen2moe`, `qwen3moe`,
`olmoe` (`engine/model/gguf_moe.py`); tensors in the types of `SUPPORTED_TYPES`, dequantized at load. What a
family's files state beyond Llama's (Granite's scales, Phi-3's partial rotary and LongRoPE factors) its
family reads (`gguf_config` of `engine/model/family.py`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.model.registry import model_family
from engine.model_config import ModelConfig, ModelConfigError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# general.architecture -> the transformers architecture the engine runs it as
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",  # (Mixtral files are llama files with experts: `_config`)
}
# ggml tensor types `gguf.dequantize` unpacks and the loader accepts
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
# tokenizer.ggml.model values transformers builds a tokenizer from (SentencePiece-style, byte-level BPE)
TOKENIZER_TYPES = ("llama", "gpt2")
_HALF_TYPES = {"F16": "float16", "BF16": "bfloat16"}
_READ_ERRORS = (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError)


class GGUFError(ModelConfigError):
    """The GGUF file is unreadable, truncated, or of an architecture or tensor type we do not run."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names, or None when `path` is not a GGUF checkpoint.

    A file counts when its name ends in `.gguf` or it starts with the GGUF magic; a directory counts
    when it has no `config.json` and holds `.gguf` files, and then it must hold exactly one.
    """
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() == GGUF_SUFFIX:
            return p
        try:
            with open(p, "rb") as f:
                return p if f.read(4) == GGUF_MAGIC else None
        except OSError as exc:
            raise GGUFError(f"{p}: cannot be read: {exc}") from exc
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == GGUF_SUFFIX and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:6])
        raise GGUFError(f"{p}: holds {len(found)} .gguf files ({names}); pass the path of one of them")
    return found[0] if found else None


def open_reader(path: Path) -> Any:
    """`gguf.GGUFReader` over `path` (memory-mapped), or GGUFError for a corrupt or truncated file.

    Parsing the header of a real model takes seconds (every vocabulary entry is a field part), and the
    config, the tokenizer check and the weights each need it: the last readers are kept, keyed by the
    file's identity (path, size, modification time)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise GGUFError(f"{path}: cannot be read: {exc}") from exc
    return _cached_reader(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, _size: int, _mtime_ns: int) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except _READ_ERRORS as exc:
        raise GGUFError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (a scalar, a string, or a list for arrays), or `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except _READ_ERRORS as exc:
        raise GGUFError(f"metadata field {key!r} is unreadable: {exc}") from exc


@dataclass(slots=True, frozen=True)
class GGUFFacts:
    """What the engine takes from a GGUF file's header: a `config.json`-style dict and rope factors."""

    path: Path
    gguf_arch: str
    config: dict[str, Any]  # Hugging Face config.json fields
    rope_freq_factors: tuple[float, ...] | None  # llama.cpp's `rope_freqs.weight` (Llama 3.x scaling)
    tensor_types: dict[str, str]  # tensor name -> ggml type name


def read_facts(path: Path) -> GGUFFacts:
    """Read `path`'s header and check that the engine can run it, or raise GGUFError saying why not."""
    reader = open_reader(path)
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    bad = sorted({ty for ty in types.values() if ty not in SUPPORTED_TYPES})
    if bad:
        raise GGUFError(
            f"{path}: tensor type {', '.join(bad)} is not supported; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    tokenizer = field_value(reader, "tokenizer.ggml.model")
    if tokenizer not in (None, *TOKENIZER_TYPES):
        raise GGUFError(
            f"{path}: tokenizer type {tokenizer!r} is not supported; supported: {', '.join(TOKENIZER_TYPES)}"
        )
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    factors = None
    if "rope_freqs.weight" in types:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = tuple(float(x) for x in dequantize_tensor(t))
    try:
        config = _config(reader, arch, path, shapes, types)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{path}: malformed metadata: {exc}") from exc
    return GGUFFacts(path, arch, config, factors, types)


def _config(reader: Any, arch: str, path: Path, shapes: dict, types: dict[str, str]) -> dict[str, Any]:
    """The `config.json` fields stated by `{arch}.*` and `tokenizer.ggml.*` metadata."""

    def need(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise GGUFError(f"{path}: per-layer {arch}.{key} is not supported")
        return value

    heads = int(need("attention.head_count"))
    kv_heads = field_value(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise GGUFError(f"{path}: per-layer {arch}.attention.head_count_kv is not supported")
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    linear = scaling == "linear" and "linear" in model_family(ARCHITECTURES[arch]).rope_types  # Gemma 3
    if scaling not in (None, "none") and not linear:
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported")
    name = str(field_value(reader, "general.name", "") or "")
    hf_arch = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in name.lower():
        hf_arch = (
            "MistralForCausalLM"  # llama.cpp files Mistral models under llama (as transformers reads it)
        )
    if arch == "llama" and field_value(reader, "llama.expert_count"):
        hf_arch = "MixtralForCausalLM"  # and Mixtral models under llama, with experts
    hidden = int(need("embedding_length"))
    eos = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := field_value(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    matmul_types = {ty for n, ty in types.items() if len(shapes[n]) == 2}
    dtype = _HALF_TYPES.get(next(iter(matmul_types)), "float32") if len(matmul_types) == 1 else "float32"
    cfg = {
        "architectures": [hf_arch],
        "model_type": {"MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral"}.get(hf_arch, arch),
        "_name_or_path": name,
        "vocab_size": shapes["token_embd.weight"][1],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(field_value(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field_value(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in types,
        "attention_bias": "blk.0.attn_q.bias" in types,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "use_sliding_window": False,
    }
    routers = {int(n.split(".")[1]) for n in shapes if re.match(r"^blk\.\d+\.ffn_gate_inp\.weight$", n)}
    if routers:  # a mixture-of-experts file: the blocks without a router have a dense MLP
        cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if i not in routers]
    family = model_family(hf_arch)
    if family.gguf_config is not None:

        def meta(key: str, default: Any = None) -> Any:
            return field_value(reader, f"{arch}.{key}", default)

        def vector(name: str) -> list[float] | None:
            t = next((t for t in reader.tensors if t.name == name), None)
            return None if t is None else [float(x) for x in dequantize_tensor(t)]

        cfg |= family.gguf_config(meta, vector)
    return cfg


def dequantize_tensor(tensor: Any) -> Any:
    """`gguf.dequantize` of one reader tensor as a float32 numpy array in row-major (HF) shape."""
    from gguf import dequantize

    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except _READ_ERRORS as exc:
        raise GGUFError(f"tensor {tensor.name!r} cannot be dequantized: {exc}") from exc


def gguf_model_config(path: Path) -> ModelConfig:
    """The engine's `ModelConfig` for the GGUF file at `path` (its `path` is the file)."""
    facts = read_facts(path)
    cfg = ModelConfig.from_dict(facts.config, path)
    types = ", ".join(sorted(set(facts.tensor_types.values())))
    cfg = replace(cfg, extra=cfg.extra | {"gguf_types": types})
    if facts.rope_freq_factors is not None:
        if len(facts.rope_freq_factors) != cfg.head_dim // 2:
            raise GGUFError(
                f"{path}: rope_freqs has {len(facts.rope_freq_factors)} factors, expected {cfg.head_dim // 2}"
            )
        scaling = {"rope_type": "freq_factors", "factors": list(facts.rope_freq_factors)}
        cfg = replace(cfg, rope_scaling=scaling)
    return cfg


def gguf_tokenizer(path: Path) -> Any | None:
    """The transformers fast tokenizer built from `path`'s `tokenizer.ggml.*` metadata (what
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds), or None when the file has no tokenizer."""
    if field_value(open_reader(path), "tokenizer.ggml.model") is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, TypeError, ImportError) as exc:
        raise GGUFError(f"{path}: cannot build its tokenizer: {exc}") from exc
