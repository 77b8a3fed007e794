"""The Triton kernels run here under triton's interpreter, on CPU tensors.

TRITON_INTERPRET is read by `triton.jit` when a kernel is decorated, so it is set before any test
module of this directory imports `latentkv.attention.triton.kernels`. A GPU machine can run the
same tests compiled with TRITON_INTERPRET=0 (the tests then put their tensors on the GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":
        from latentkv.attention.triton.interpreter import fix_bf16_dot

        fix_bf16_dot()
