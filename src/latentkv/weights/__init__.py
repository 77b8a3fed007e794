"""Weight formats: every matmul of the model goes through a `Linear` object.

    lin = make_linear(w, "bf16")        # w: float [out, in]; any registered format
    y = lin(x)                          # x [..., in] float32 -> [..., out] float32
    lin.dequantize()                    # float32 [out, in]: the reference a format is tested against

A new format is one file here: a `Linear` subclass decorated with `@register` (see base.py).
"""

import torch

from latentkv import native
from latentkv.weights import bf16, f32, int4, int8  # noqa: F401  (register the built-in formats)
from latentkv.weights.base import (
    FORMATS,
    Linear,
    dense_dtype,
    format_class,
    format_names,
    make_linear,
    register,
)
from latentkv.weights.kernels import cpu_features, matmul_dtype

__all__ = [
    "FORMATS",
    "Linear",
    "dense_dtype",
    "describe",
    "format_class",
    "format_names",
    "make_linear",
    "register",
]


def describe(fmt: str) -> str | None:
    """One line for the start of a run: which kernel a format uses on this CPU; None for a
    format that is plain torch matmul in float32 (nothing to say)."""
    f = cpu_features()
    extras = [name for name in ("vnni", "avx512_bf16", "amx") if f[name]]
    cpu = str(f["capability"]) + (f" + {', '.join(extras)}" if extras else "")
    tile = "bf16" if matmul_dtype() == torch.bfloat16 else "f32"
    gemm = "oneDNN bf16 GEMM" + (" (AMX)" if f["amx"] and f["mkldnn_bf16"] else "")
    own = native.kernels()
    if own is not None:
        acts = {"int8": native.ACTIVATIONS[own.isa], "int4": native.ACTIVATIONS[own.isa4]}
        decode = {fmt: f"latentkv's {own.name} kernel ({acts[fmt]} activations)" for fmt in acts}
        int4_prefill = f"dequantized {tile} tiles"
    else:
        why = native.unavailable()
        note = f" (latentkv's kernels unavailable: {why})" if why else ""
        decode = {
            "int8": "torch's _weight_int8pack_mm" + note,
            "int4": "torch's _weight_int4pack_mm_for_cpu" + note,
        }
        int4_prefill = "dequantized bf16 tiles" if int4.prefill_tiles() else "the same op"
    big = "torch.mv (bf16 GEMV, f32 accumulation)" if bf16.gemv_one_row() else "torch matmul"
    mib = bf16.NATIVE_MAX_BYTES >> 20
    one_row = (
        f"latentkv's {own.name} kernel up to {mib} MiB matrices, {big} above" if own is not None else big
    )
    kernels = {
        "bf16": f"one row via {one_row}, more rows via {gemm}"
        if own is not None or bf16.gemv_one_row()
        else "torch matmul",
        "int8": f"decode via {decode['int8']}, prefill via dequantized {tile} tiles",
        "int4": f"decode via {decode['int4']}, prefill via {int4_prefill}",
    }
    how = kernels.get(fmt)
    return None if how is None else f"weights: {fmt} {how} ({cpu})"
