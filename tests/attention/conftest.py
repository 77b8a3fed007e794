"""The Triton kernels run here under triton's interpreter, on CPU tensors.

TRITON_INTERPRET is read by `triton.jit` when a kernel is decorated, so it is set before any test
module of this directory imports `latentkv.attention.triton.kernels`. A GPU machine can run the
same tests compiled with TRITON_INTERPRET=0 (the tests then put their tensors on the GPU).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_bf16_dot() -> None:
    """triton 3.9's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 bits
    (numpy has no bfloat16); widen them to float32 first, as the tensor cores do exactly."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    if not getattr(original, "widens_bf16", False):
        create_dot.widens_bf16 = True
        interpreter.InterpreterBuilder.create_dot = create_dot


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_bf16_dot()


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where the kernels' tensors live: the CPU under the interpreter, else the GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device")
    return "cuda"
