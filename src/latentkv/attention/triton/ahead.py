"""Compile the decode kernel ahead of time for a GPU this machine does not have.

Triton's compiler and NVIDIA's ptxas (shipped in the triton wheel) run on any Linux machine, so
a CPU-only machine can check that the kernel compiles for a target (the interpreter that runs
the tests checks no types or layouts) and read what the compiled kernel costs: registers and
spill stack per thread, shared memory, and how its loads came out (16-byte vectors or bytes).

    report = compile_decode(codec_c, codec_r, arch=90)     # sm_90: H100 / H200

It needs a process where triton does not interpret (TRITON_INTERPRET unset): under the
interpreter even triton's own library functions are decorated for it. The signature mirrors a launch by `decode.mla_decode` with 16-byte aligned rows and strides (what
a cache's buffers give), so the compiled code is the one a GPU would run.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass

import triton
from triton.backends.compiler import GPUTarget

from latentkv.attention.triton import kernels
from latentkv.attention.triton.decode import BLOCK_H, BLOCK_T, NUM_WARPS, PRECISIONS
from latentkv.attention.triton.formats import part_format
from latentkv.kv.codecs import Codec

_POINTERS = {
    "q_ptr": "*fp32",
    "c_codes": "*i64",
    "c_scales": "*i64",
    "r_codes": "*i64",
    "r_scales": "*i64",
    "c_table": "*fp32",
    "r_table": "*fp32",
    "lengths": "*i32",
    "index": "*i32",
    "out_ptr": "*fp32",
    "lse_ptr": "*fp32",
}
_FLOATS = {"c_gain", "r_gain"}
# integer arguments a real launch passes as multiples of 16 (triton specializes on that)
_ALIGNED = {"stride_qb", "stride_qh", "c_stride", "r_stride", "stride_ob", "stride_os", "stride_oh"}


@dataclass(frozen=True)
class Compiled:
    """What one compiled variant of the split kernel costs per thread and per program."""

    arch: int
    precision: str
    registers: int
    stack_bytes: int  # spilled registers and local arrays
    shared_bytes: int
    loads: dict[str, int]  # PTX global loads by width (static count in the kernel's code)
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def compile_decode(
    codec_c: Codec,
    codec_r: Codec,
    *,
    arch: int = 90,
    precision: str = "bf16",
    block_t: int = BLOCK_T,
    block_h: int = BLOCK_H,
    num_warps: int = NUM_WARPS,
    num_stages: int = 2,
    gather: bool = False,
) -> Compiled:
    """Compile `kernels.mla_decode_split` for sm_`arch` over rows of this codec pair."""
    import time

    fc, fr = part_format(codec_c), part_format(codec_r)
    constants = {
        "CF": fc.constants(),
        "RF": fr.constants(),
        "C_ALIGN": 16,
        "R_ALIGN": 16,
        "BLOCK_H": block_h,
        "BLOCK_T": block_t,
        "GATHER": gather,
        "DOT": PRECISIONS[precision],
    }
    kernel = kernels.mla_decode_split
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError(
            "the kernels were decorated for triton's interpreter (TRITON_INTERPRET=1): compile in another process"
        )
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {
        n: "constexpr" if n in constants else _POINTERS.get(n, "fp32" if n in _FLOATS else "i32")
        for n in names
    }
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*_POINTERS, *_ALIGNED)}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    start = time.perf_counter()
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    seconds = time.perf_counter() - start
    registers, stack = _resource_usage(compiled.asm["cubin"])
    loads = Counter(re.findall(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[.\w]*", compiled.asm["ptx"]))
    return Compiled(
        arch, precision, registers, stack, compiled.metadata.shared, dict(loads), round(seconds, 2)
    )


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread, as cuobjdump reads them from the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {text[-300:]}")
    return int(match.group(1)), int(match.group(2))
