"""Compile a C source of this package into a shared library once per machine, and load it.

The library is built with the system C compiler (``$CC``, else ``cc``/``gcc``: the same one Triton's
runtime needs), and cached under ``$XDG_CACHE_HOME/loraplex/native`` (default ``~/.cache``) by a key over
the sources (the ``.c`` file and the headers beside it), the flags, the compiler's version and the CPU's
feature flags, so a changed source or another CPU gets a fresh build. Concurrent builds (several test
workers) are safe: each writes a private file and renames it into place.

A source can be built in *variants*: the same file compiled once per set of extra flags (e.g. one per
instruction-set level, ``-DLORA_ISA=avx2 -mavx2 ...``) and linked into one library, whose caller picks
the variant the CPU runs at load time. Without variants the source is built for the CPU at hand
(``-march=native``).

OpenMP (``-fopenmp``) links ``libgomp.so.1``, the soname of the runtime torch's CPU build ships, so the
library shares torch's OpenMP runtime and threads. When that build fails or does not load, it is
retried without OpenMP (single-threaded).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-fPIC", "-std=gnu11")
NATIVE = ("-march=native",)


class NativeBuildError(RuntimeError):
    """No C compiler, or the source did not compile here."""


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "loraplex" / "native"


def compiler() -> str:
    """The C compiler to use: ``$CC``, else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"C compiler {cc!r} does not run: {exc}") from exc


def build_library(source_name: str, variants: Sequence[tuple[str, ...]] = (NATIVE,)) -> ctypes.CDLL:
    """Compile ``csrc/<source_name>`` once per entry of `variants` (extra flags), link the objects into one
    library (or reuse the cached build) and load it. Raises NativeBuildError."""
    source = CSRC / source_name
    cc = compiler()
    version = _compiler_version(cc)
    sources = b"".join(p.read_bytes() for p in (source, *sorted(CSRC.glob("*.h"))))
    errors = []
    for extra in (("-fopenmp",), ()):
        flags = (*BASE_FLAGS, *extra)
        key = hashlib.sha256(
            b"\0".join(
                s.encode() if isinstance(s, str) else s
                for s in (sources, " ".join(flags), repr(variants), version, _cpu_flags(), platform.machine())
            )
        ).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        try:
            if not target.exists():
                _compile(cc, source, flags, variants, target)
            return ctypes.CDLL(str(target))
        except (NativeBuildError, OSError) as exc:  # OSError: built, but it does not load here
            errors.append(str(exc))
    raise NativeBuildError(f"could not build {source_name}:\n" + "\n".join(errors))


def _compile(
    cc: str, source: Path, flags: tuple[str, ...], variants: Sequence[tuple[str, ...]], target: Path
) -> None:
    """One object per variant in a private temporary directory, linked into `target` (renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.stem}-") as tmp:
        objects = [f"{tmp}/{i}.o" for i in range(len(variants))]
        commands = [
            [cc, *flags, *v, "-c", "-o", o, str(source)] for v, o in zip(variants, objects, strict=True)
        ]
        commands.append([cc, *flags, "-shared", "-o", f"{tmp}/lib.so", *objects])
        for cmd in commands:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as exc:
                raise NativeBuildError(f"{cc} {source.name}: {exc}") from exc
            if proc.returncode != 0:
                raise NativeBuildError(f"{' '.join(cmd[:-1])} {source.name}: {proc.stderr.strip()}")
        os.replace(f"{tmp}/lib.so", target)


# The instruction-set levels of the native CPU kernels on x86-64, lowest first, as `csrc/cpu_isa.h` checks
# them: generic; AVX2 + FMA + F16C; that + AVX-512 F/BW/VL (+ BF16 for a kernel that needs it).
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl")


def build_isa_levels(
    source_name: str,
    macro: str,
    levels: Sequence[tuple[str, tuple[str, ...]]],
    probe: str,
    extra: tuple[str, ...] = (),
) -> tuple[ctypes.CDLL, tuple[str, ...]]:
    """Build `csrc/<source_name>` once per level of `levels` ((name, compiler flags), lowest first; level
    i compiled with ``-D<macro>=<name> -D<macro>_LEVEL=i`` and `extra`) into one library, and return it
    with the names of the levels this CPU runs (asked of the generic build's function `probe`, which
    takes a level index). Not on x86-64: one build for this CPU (``-march=native``), level ``generic``.
    Raises NativeBuildError."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return build_library(source_name, [(*NATIVE, *extra)]), ("generic",)
    variants = [
        (f"-D{macro}={name}", f"-D{macro}_LEVEL={i}", *flags, *extra)
        for i, (name, flags) in enumerate(levels)
    ]
    lib = build_library(source_name, variants)
    supported = getattr(lib, probe)
    return lib, tuple(name for i, (name, _) in enumerate(levels) if supported(i))


def isa_entry(
    library: tuple[ctypes.CDLL, tuple[str, ...]], op: str, symbol: str, isa: str | None, argtypes: list
) -> Callable[..., int]:
    """The entry point `{symbol}_{isa}` of a `build_isa_levels` library (`isa` None: the highest level this
    CPU runs), typed with `argtypes` and an int result. ValueError naming `op` for a level not available."""
    lib, runs = library
    isa = isa or runs[-1]
    if isa not in runs:
        raise ValueError(f"{op}: instruction set {isa!r} is not available here (have {', '.join(runs)})")
    fn = getattr(lib, f"{symbol}_{isa}")
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
