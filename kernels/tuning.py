"""Block-size configs: each launcher asks the hook for a tuned config first, then uses its heuristic.

A hook is ``hook(op, problem) -> dict | None``; ``op`` is e.g. ``"lora_shrink"`` and ``problem`` a
dict of the launch's sizes (documented per launcher). A returned dict overrides the heuristic's keys
(``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``num_warps``, ``num_stages`` where the kernel
has them); unknown keys are ignored. Tuned tables (e.g. JSON per GPU) plug in here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

ConfigHook = Callable[[str, Mapping[str, int]], Mapping[str, int] | None]

_hook: ConfigHook | None = None


def set_config_hook(hook: ConfigHook | None) -> ConfigHook | None:
    """Install ``hook`` (``None`` removes it); returns the previous hook so callers can restore it."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def resolve_config(op: str, problem: Mapping[str, int], default: dict[str, int]) -> dict[str, int]:
    """``default`` updated with the hook's config for ``(op, problem)``, restricted to known keys."""
    if _hook is None:
        return default
    tuned = _hook(op, problem)
    if not tuned:
        return default
    merged = dict(default)
    merged.update({k: int(v) for k, v in tuned.items() if k in default})
    return merged
