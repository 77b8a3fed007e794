"""Weight formats: every matmul of the model goes through a `Linear` object.

    lin = make_linear(w, "bf16")        # w: float [out, in]; any registered format
    y = lin(x)                          # x [..., in] float32 -> [..., out] float32
    lin.dequantize()                    # float32 [out, in]: the reference a format is tested against

A new format is one file here: a `Linear` subclass decorated with `@register` (see base.py).
"""

from latentkv.weights import bf16, f32  # noqa: F401  (register the built-in formats)
from latentkv.weights.base import FORMATS, Linear, make_linear, register

__all__ = ["FORMATS", "Linear", "make_linear", "register"]
