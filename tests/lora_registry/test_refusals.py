"""Every refused upload gives a clear error and leaves no row, no blob and no temp file behind."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path

import pytest
import torch

from lora_registry.errors import InvalidAdapter, InvalidName
from lora_registry.registry import Registry
from tests.engine.lora.peft_factory import edit_config, read_tensors, write_tensors

PREFIX = "base_model.model.model.layers"


def assert_nothing_left(registry: Registry) -> None:
    svc = registry.adapters
    assert svc.list() == []
    assert svc.blobs.digests() == []
    assert svc.audit_log() == []
    for leftovers in (svc.settings.data_dir / "tmp", svc.blobs.root / "tmp"):
        assert not leftovers.exists() or list(leftovers.iterdir()) == []


def _pickle(d: Path) -> None:
    state = read_tensors(d)
    (d / "adapter_model.safetensors").unlink()
    torch.save(state, d / "adapter_model.bin")


def _set(key: str, value):
    def fn(d: Path) -> None:
        t = read_tensors(d)
        t[key] = value(t)
        write_tensors(d, t)

    return fn


def _truncate(d: Path) -> None:
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _nan(t):
    x = t[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"].clone()
    x[3, 1] = float("nan")
    return x


CASES = {
    "pickle": (_pickle, r"adapter_model\.bin: pickle weights are refused"),
    "wrong-shape": (
        _set(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", lambda t: torch.randn(4, 65)),
        r"shape \[4, 65\] does not fit the base model's q_proj",
    ),
    "bad-json": (
        lambda d: (d / "adapter_config.json").write_text("{'r': 4"),
        r"adapter_config\.json: not valid JSON",
    ),
    "rank-too-large": (
        lambda d: edit_config(d, r=128),
        "r: rank 128 of layer 0 q_proj exceeds max_lora_rank 64",
    ),
    "unknown-module": (
        lambda d: edit_config(d, target_modules=["q_proj", "v_proj", "fc9"]),
        "unknown module name 'fc9'",
    ),
    "nan": (_set(f"{PREFIX}.1.self_attn.v_proj.lora_B.weight", _nan), "contains NaN or Inf"),
    "truncated": (_truncate, "truncated"),
    "dora-without-magnitudes": (
        lambda d: edit_config(d, use_dora=True),
        "use_dora: DoRA's lora_magnitude_vector partner is missing",
    ),
    "dora-with-lora-bias": (
        lambda d: edit_config(d, use_dora=True, lora_bias=True),
        "lora_bias: not supported together with use_dora",
    ),
    "modules-to-save-missing-copy": (
        lambda d: edit_config(d, modules_to_save=["lm_head"]),
        r"modules_to_save\[0\]: 'lm_head' has no saved weight",
    ),
    "trainable-tokens": (
        lambda d: edit_config(d, trainable_token_indices=[3, 4]),
        r"trainable_token_indices\['embed_tokens'\]: its trainable_tokens_delta is missing",
    ),
    "tied-vocab-loras": (lambda d: edit_config(d, ensure_weight_tying=True), "ensure_weight_tying"),
    "other-embedding-target": (
        lambda d: edit_config(d, target_modules=["q_proj", "v_proj", "wte"]),
        "'wte' is an embedding/lm_head target, which is not supported",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_adapter_directory(case: str, registry: Registry, adapter_copy) -> None:
    mutate, message = CASES[case]
    d = adapter_copy("a")
    mutate(d)
    with pytest.raises(InvalidAdapter, match=message):
        registry.adapters.register("bot", d)
    assert_nothing_left(registry)


@pytest.mark.parametrize("name", ["../x", "Bot", "", "-x", "a" * 65, "a/b", "a b", ".hidden"])
def test_bad_names_refused(name: str, registry: Registry, adapter_dirs) -> None:
    with pytest.raises(InvalidName, match="is invalid"):
        registry.adapters.register(name, adapter_dirs["a"])
    assert_nothing_left(registry)


def _zip(path: Path, entries: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return path


def _files(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}


def test_zip_upload_registers_same_digest_as_the_directory(
    registry: Registry, adapter_dirs, tmp_path
) -> None:
    files = _files(adapter_dirs["a"])
    z = _zip(
        tmp_path / "up.zip",
        {f"my-adapter/{k}": v for k, v in files.items()} | {"my-adapter/README.md": b"hi"},
    )
    res = registry.adapters.register("bot", z)
    assert res.created and res.version.source == "zip:up.zip"
    assert not registry.adapters.register("bot", adapter_dirs["a"]).created  # same content
    flat = _zip(tmp_path / "flat.zip", _files(adapter_dirs["b"]))
    assert registry.adapters.register("bot", flat).version.version == 2


def _zip_cases(files: dict[str, bytes]) -> dict[str, tuple[dict, dict, str]]:
    cfg, w = files["adapter_config.json"], files["adapter_model.safetensors"]
    return {
        "dotdot": (
            {"adapter_config.json": cfg, "adapter_model.safetensors": w, "../evil.txt": b"x"},
            {},
            r"'\.\.'",
        ),
        "dotdot-inner": ({"a/../../adapter_config.json": cfg, "adapter_model.safetensors": w}, {}, r"'\.\.'"),
        "absolute": ({"/etc/adapter_config.json": cfg, "adapter_model.safetensors": w}, {}, "absolute"),
        "backslash": (
            {"..\\adapter_config.json": cfg, "adapter_model.safetensors": w},
            {},
            "absolute or non-POSIX",
        ),
        "symlink": ({"adapter_config.json": cfg}, {"adapter_model.safetensors": "/etc/passwd"}, "links"),
        "pickle": ({"adapter_config.json": cfg, "adapter_model.bin": w}, {}, "pickle weights are refused"),
        "two-adapters": (
            {"x/adapter_config.json": cfg, "x/adapter_model.safetensors": w, "y/adapter_config.json": cfg},
            {},
            "one adapter per zip",
        ),
        "no-config": ({"adapter_model.safetensors": w}, {}, "no adapter_config.json"),
        "bomb": (
            {"adapter_config.json": cfg, "adapter_model.safetensors": w, "pad.bin": b"\0" * 3_000_000},
            {},
            "unpacks to more than",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "dotdot",
        "dotdot-inner",
        "absolute",
        "backslash",
        "symlink",
        "pickle",
        "two-adapters",
        "no-config",
        "bomb",
    ],
)
def test_refused_zip(case: str, registry: Registry, adapter_dirs, tmp_path: Path) -> None:
    entries, links, message = _zip_cases(_files(adapter_dirs["a"]))[case]
    z = _zip(tmp_path / "bad.zip", entries, links)
    registry.adapters.settings = _small(registry)
    with pytest.raises(InvalidAdapter, match=message):
        registry.adapters.register("bot", z)
    assert_nothing_left(registry)
    assert not (tmp_path.parent / "evil.txt").exists()


def _small(registry: Registry):
    from dataclasses import replace

    return replace(registry.adapters.settings, max_unpacked_bytes=1_000_000)


def test_zip_lying_about_its_size_is_stopped_while_extracting(
    registry: Registry, adapter_dirs, tmp_path
) -> None:
    files = _files(adapter_dirs["a"])
    z = _zip(tmp_path / "liar.zip", files)
    data = bytearray(z.read_bytes())
    # patch the declared uncompressed size of the weights entry (central directory) to 10 bytes
    with zipfile.ZipFile(z) as zf:
        info = zf.getinfo("adapter_model.safetensors")
    real = info.file_size.to_bytes(4, "little")
    idx = data.rfind(b"PK\x01\x02")  # last central-directory header = the weights entry
    assert data[idx + 24 : idx + 28] == real
    data[idx + 24 : idx + 28] = (10).to_bytes(4, "little")
    z.write_bytes(bytes(data))
    with pytest.raises(InvalidAdapter):
        registry.adapters.register("bot", z)
    assert_nothing_left(registry)


def test_not_a_zip_or_dir(registry: Registry, tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(InvalidAdapter, match="not a PEFT adapter directory or a zip"):
        registry.adapters.register("bot", tmp_path / "x.txt")
    with pytest.raises(InvalidAdapter, match="no such file"):
        registry.adapters.register("bot", tmp_path / "missing")
    assert_nothing_left(registry)


def test_failure_after_blobs_are_written_removes_them(registry: Registry, adapter_dirs, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(registry.adapters, "_insert_version", boom)
    with pytest.raises(OSError, match="disk full"):
        registry.adapters.register("bot", adapter_dirs["a"])
    assert_nothing_left(registry)
