"""Hostile adapter configs and zips (admin plane): every field's type and size is bounded (422 naming
the field), user regexes are limited to a language that cannot backtrack catastrophically, zip bombs
are refused by compression ratio and weights by the largest adapter the model admits — before any of
it is parsed, run, unpacked or read into memory. Nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from lora_registry.errors import InvalidAdapter
from lora_registry.registry import Registry
from lora_registry.safe_regex import UnsafePattern, check_pattern
from tests.engine.lora.peft_factory import edit_config
from tests.lora_registry.test_refusals import assert_nothing_left


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


CASES = {
    "deep-nesting": (
        lambda d: (d / "adapter_config.json").write_text('{"r": 4, "x": ' + "[" * 5000 + "]" * 5000 + "}"),
        "nested more than 8 levels",
    ),
    "moderate-nesting": (lambda d: edit_config(d, extra=_nested(20)), "field 'extra': nested more than 8"),
    "non-string-base-model": (
        lambda d: edit_config(d, base_model_name_or_path={"evil": 1}),
        "field 'base_model_name_or_path': expected a string or null, got an object",
    ),
    "long-base-model": (
        lambda d: edit_config(d, base_model_name_or_path="m" * 600),
        "field 'base_model_name_or_path': 600 characters",
    ),
    "long-unknown-field": (
        lambda d: edit_config(d, notes="x" * 100_000),
        "field 'notes': a string of 100000",
    ),
    "huge-file": (
        lambda d: edit_config(d, notes="x" * (50 * 1024 * 1024)),
        r"adapter_config\.json: \d+ bytes \(at most 262144\)",
    ),
    "regex-backtracking": (
        lambda d: edit_config(d, target_modules=r"(a+)+$"),
        "field 'target_modules': pattern .* refused: a quantifier may only follow",
    ),
    "regex-backreference": (
        lambda d: edit_config(d, target_modules=r"(q)_proj\1"),
        "backreferences are not allowed",
    ),
    "rank-pattern-regex": (
        lambda d: edit_config(d, rank_pattern={r"(.*a){20}": 4}),
        r"field \"rank_pattern\['\(\.\*a\)\{20\}'\]\": pattern",
    ),
    "rank-pattern-value": (
        lambda d: edit_config(d, rank_pattern={"q_proj": "four"}),
        "expected a number, got a string",
    ),
    "module-list-type": (
        lambda d: edit_config(d, target_modules=["q_proj", 7]),
        r"field 'target_modules\[1\]': expected a string, got a number",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_config_is_refused_naming_the_field(case: str, registry: Registry, adapter_copy) -> None:
    mutate, message = CASES[case]
    d = adapter_copy("a")
    mutate(d)
    t0 = time.monotonic()
    with pytest.raises(InvalidAdapter, match=message):
        registry.adapters.register("bot", d)
    assert time.monotonic() - t0 < 10
    assert_nothing_left(registry)


def test_ordinary_peft_configs_still_register(registry: Registry, adapter_copy) -> None:
    d = adapter_copy("a")
    edit_config(
        d,
        target_modules=r".*\.(q_proj|v_proj)",
        rank_pattern={r"model\.layers\.\d+\.self_attn\.q_proj": 4},
        notes="trained on support tickets",
        auto_mapping=None,
        init_lora_weights="gaussian",
    )
    info = registry.adapters.register("bot", d).version
    assert set(info.target_modules) == {"q_proj", "v_proj"}


@pytest.mark.parametrize(
    "pattern", [r"(a+)+$", r"(x+x+)+y", r"(a|aa)*b", r"(?=q)q_proj", ".*" * 4, r"(\w+\.)*q", "a" * 300]
)
def test_unsafe_patterns_are_refused_without_running_them(pattern: str) -> None:
    with pytest.raises(UnsafePattern):
        check_pattern(pattern)


def test_the_worst_accepted_pattern_matches_fast() -> None:
    keys = [f"model.layers.{i}.{p}" for i in range(128) for p in ("self_attn.q_proj", "mlp.down_proj")]
    for pattern in (r".*.*.*#", r"(.*\.)?(.*.*#)", r"[a-z0-9._]*[a-z0-9._]*[a-z0-9._]*#"):
        check_pattern(pattern)
        rx = re.compile(pattern)
        t0 = time.perf_counter()
        assert not any(rx.fullmatch(k) for k in keys)
        assert time.perf_counter() - t0 < 1.0


def _bomb_zip(path: Path, adapter: Path, pad_name: str, pad_bytes: int) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.write(adapter / "adapter_config.json", "adapter_config.json")
        zf.write(adapter / "adapter_model.safetensors", "adapter_model.safetensors")
        zf.writestr(pad_name, b"\0" * pad_bytes)
    return path


def test_zip_bomb_is_refused_by_compression_ratio_before_unpacking(
    registry: Registry, adapter_dirs, tmp_path: Path
) -> None:
    z = _bomb_zip(tmp_path / "bomb.zip", adapter_dirs["a"], "pad.bin", 64 * 1024 * 1024)
    assert z.stat().st_size < 1024 * 1024  # 64 MiB of zeros deflate to well under 1 MiB
    with pytest.raises(InvalidAdapter, match=r"zip entry 'pad.bin': compressed \d+:1"):
        registry.adapters.register("bot", z)
    assert_nothing_left(registry)


def test_weights_larger_than_any_valid_adapter_are_refused_before_reading(
    registry: Registry, adapter_dirs, tmp_path: Path
) -> None:
    registry.adapters.settings = replace(registry.adapters.settings, max_lora_rank=8)
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes((adapter_dirs["a"] / "adapter_config.json").read_bytes())
    header = json.dumps({"__metadata__": {}}).encode()
    with (big / "adapter_model.safetensors").open("wb") as f:  # a sparse 3 GiB file: nothing to read
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(3 * 1024**3)
    with pytest.raises(InvalidAdapter, match="the largest adapter this model admits"):
        registry.adapters.register("bot", big)
    z = tmp_path / "big.zip"
    with zipfile.ZipFile(z, "w") as zf:  # stored, 3 MiB: over the limit by its declared size
        zf.write(big / "adapter_config.json", "adapter_config.json")
        zf.writestr("adapter_model.safetensors", os.urandom(3 * 1024 * 1024))
    with pytest.raises(InvalidAdapter, match="the largest adapter this model admits"):
        registry.adapters.register("bot", z)
    assert_nothing_left(registry)
