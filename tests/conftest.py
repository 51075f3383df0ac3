"""Session-wide test settings.

Triton kernels run on CPU only through Triton's interpreter, chosen when a kernel is decorated, so the
variable is set here, before any test imports `kernels`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
