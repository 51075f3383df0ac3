"""Turn an upload (a PEFT directory or a zip of one) into a private staging directory.

Zip archives are checked entry by entry before anything is extracted: no absolute paths, no `..`, no
links, no encrypted or duplicate entries, a cap on the number of entries, on the unpacked size, on each
entry's compression ratio (a zip bomb inflates 1000:1; model weights barely compress) and on the
weights' size (the largest adapter the model admits); sizes are enforced again while streaming the
entries out, since a zip's declared sizes can lie. Only the two adapter files are
extracted; pickle weights without safetensors are refused.
"""

from __future__ import annotations

import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.lora.adapter_checkpoint import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from lora_registry.errors import InvalidAdapter
from lora_registry.progress import NoProgress, ProgressReporter

_CHUNK = 1 << 20
RATIO_FLOOR_BYTES = 1 << 20  # smaller entries (the config) may compress as well as they like


@dataclass(slots=True, frozen=True)
class UploadLimits:
    max_upload_bytes: int
    max_unpacked_bytes: int
    max_entries: int
    max_ratio: float = 100.0  # unpacked : packed bytes of one entry (entries over 1 MiB unpacked)
    max_weights_bytes: int | None = None  # the largest adapter the base model admits


@dataclass(slots=True, frozen=True)
class StagedAdapter:
    directory: Path  # holds exactly adapter_config.json and adapter_model.safetensors
    source: str  # where it came from, for the version record


@contextmanager
def stage_upload(
    source: Path, staging_root: Path, limits: UploadLimits, progress: ProgressReporter | None = None
) -> Iterator[StagedAdapter]:
    """Copy (or safely extract) the adapter at `source` into a temp dir in `staging_root`, removed on exit."""
    progress = progress or NoProgress()
    source = Path(source)
    if source.is_dir():
        files = _dir_files(source)
        kind = "dir"
    elif source.is_file() and zipfile.is_zipfile(source):
        kind = "zip"
    elif source.exists():
        raise InvalidAdapter(f"{source}: not a PEFT adapter directory or a zip file")
    else:
        raise InvalidAdapter(f"{source}: no such file or directory")
    staging_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="stage-", dir=staging_root))
    try:
        if kind == "dir":
            total = sum(f.stat().st_size for f in files)
            _check_weights_size(files[1].stat().st_size, limits)
            if total > limits.max_upload_bytes:
                raise InvalidAdapter(
                    f"{source}: {total} bytes exceeds the upload limit of {limits.max_upload_bytes}"
                )
            advance = progress.phase("copying", total)
            for f in files:
                _copy(f, tmp / f.name, advance)
        else:
            _extract_zip(source, tmp, limits, progress)
        yield StagedAdapter(tmp, f"{kind}:{source.name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dir_files(root: Path) -> list[Path]:
    cfg, weights = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not cfg.is_file():
        raise InvalidAdapter(f"{CONFIG_FILE}: missing in {root}")
    if not weights.is_file():
        _refuse_missing_weights([p for p in PICKLE_FILES if (root / p).exists()], root)
    return [cfg, weights]


def _refuse_missing_weights(pickled: list[str], where: object) -> None:
    if pickled:
        raise InvalidAdapter(
            f"{pickled[0]}: pickle weights are refused (unsafe to load); save as {WEIGHTS_FILE}"
        )
    raise InvalidAdapter(f"{WEIGHTS_FILE}: missing in {where}")


def _copy(src: Path, dst: Path, advance: object) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(_CHUNK):
            fout.write(chunk)
            advance(len(chunk))  # type: ignore[operator]


def check_zip_entries(zf: zipfile.ZipFile, limits: UploadLimits) -> tuple[zipfile.ZipInfo, zipfile.ZipInfo]:
    """Check every entry of `zf`; return the (config, weights) entries of the one adapter inside."""
    infos = zf.infolist()
    if len(infos) > limits.max_entries:
        raise InvalidAdapter(f"zip: {len(infos)} entries (at most {limits.max_entries} allowed)")
    seen: set[str] = set()
    total = 0
    for info in infos:
        name = info.filename
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name:
            raise InvalidAdapter(f"zip entry {name!r}: absolute or non-POSIX path refused")
        if ".." in PurePosixPath(name).parts:
            raise InvalidAdapter(f"zip entry {name!r}: '..' path components refused")
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the zip records no file type
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise InvalidAdapter(f"zip entry {name!r}: links and special files refused")
        if info.flag_bits & 0x1:
            raise InvalidAdapter(f"zip entry {name!r}: encrypted entries refused")
        if name in seen:
            raise InvalidAdapter(f"zip entry {name!r}: duplicate entry")
        seen.add(name)
        total += info.file_size
        if total > limits.max_unpacked_bytes:
            raise InvalidAdapter(f"zip: unpacks to more than {limits.max_unpacked_bytes} bytes")
        if info.file_size > RATIO_FLOOR_BYTES and info.file_size > limits.max_ratio * info.compress_size:
            ratio = info.file_size / max(1, info.compress_size)
            raise InvalidAdapter(
                f"zip entry {name!r}: compressed {ratio:.0f}:1 (at most {limits.max_ratio:.0f}:1 is "
                "accepted; adapter weights barely compress)"
            )
    files = {PurePosixPath(i.filename): i for i in infos if not i.is_dir()}
    configs = [p for p in files if p.name == CONFIG_FILE and len(p.parts) <= 2]
    if not configs:
        raise InvalidAdapter(f"zip: no {CONFIG_FILE} at the top level or in one top-level folder")
    if len(configs) > 1:
        raise InvalidAdapter(f"zip: {len(configs)} {CONFIG_FILE} files; upload one adapter per zip")
    folder = configs[0].parent
    weights = files.get(folder / WEIGHTS_FILE)
    if weights is None:
        _refuse_missing_weights([p for p in PICKLE_FILES if folder / p in files], "the zip")
    _check_weights_size(weights.file_size, limits)  # type: ignore[union-attr]
    return files[configs[0]], weights  # type: ignore[return-value]


def _check_weights_size(size: int, limits: UploadLimits) -> None:
    if limits.max_weights_bytes is not None and size > limits.max_weights_bytes:
        raise InvalidAdapter(
            f"{WEIGHTS_FILE}: {size} bytes; the largest adapter this model admits has "
            f"{limits.max_weights_bytes} bytes"
        )


def _extract_zip(source: Path, dest: Path, limits: UploadLimits, progress: ProgressReporter) -> None:
    size = source.stat().st_size
    if size > limits.max_upload_bytes:
        raise InvalidAdapter(
            f"{source.name}: {size} bytes exceeds the upload limit of {limits.max_upload_bytes}"
        )
    try:
        with zipfile.ZipFile(source) as zf:
            entries = check_zip_entries(zf, limits)
            advance = progress.phase("unpacking", sum(e.file_size for e in entries))
            budget = limits.max_unpacked_bytes
            for entry, target in zip(entries, (CONFIG_FILE, WEIGHTS_FILE), strict=True):
                written = 0
                with zf.open(entry) as fin, (dest / target).open("wb") as fout:
                    while chunk := fin.read(_CHUNK):
                        written += len(chunk)
                        if written > entry.file_size or written > budget:
                            raise InvalidAdapter(
                                f"zip entry {entry.filename!r}: unpacks beyond its declared size"
                            )
                        fout.write(chunk)
                        advance(len(chunk))
                budget -= written
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError) as exc:
        raise InvalidAdapter(f"{source.name}: corrupt or unsupported zip ({exc})") from exc
