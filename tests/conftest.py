"""Session-wide test settings.

Triton kernels run on CPU only through Triton's interpreter, chosen when a kernel is decorated, so the
variable is set here, before any test imports `kernels`.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """A tiny llama with a character tokenizer, three PEFT adapters for it, and the PEFT oracle."""
    from tests.helpers.served import build_text_model

    return build_text_model(tmp_path_factory.mktemp("served"))
