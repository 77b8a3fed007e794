"""Running the kernels under triton's interpreter (TRITON_INTERPRET=1), on CPU tensors.

The tests and `benchmarks/gpu_check.py --dry-run` run the decode kernel this way: numpy executes
each program, so a machine without a GPU checks the kernel's arithmetic against the references.
"""

from __future__ import annotations


def fix_bf16_dot() -> None:
    """triton 3.9's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 bits
    (numpy has no bfloat16): widen them to float32 first, which is exact, as on the tensor cores.
    Idempotent; a no-op where triton is not installed."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "widens_bf16", False):
        return

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True
    interpreter.InterpreterBuilder.create_dot = create_dot
