"""Kernel tests run the real @triton.jit code on CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any kernel module is imported (``triton.jit`` picks the
interpreter at decoration time); conftest modules load before test modules, and
``test_interpreter.py`` verifies that it took effect.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 warning; keeps its default
