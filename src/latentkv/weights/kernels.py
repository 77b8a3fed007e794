"""What this CPU offers the quantized formats, asked once (on first use, never at import).

torch's int8/int4 CPU ops pick their own vector path from the CPU (`get_cpu_capability`:
AVX512, AVX2 or a scalar DEFAULT); a CPU without AVX-512/VNNI/AMX still runs them. The
dequantized-tile prefill path computes in bfloat16 only where oneDNN has native bf16
(AVX512-BF16 or AMX): elsewhere a bf16 matmul is emulated and float32 is faster.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_features() -> dict[str, bool | str]:
    """The CPU features the weight kernels care about."""
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "vnni": bool(torch.cpu._is_vnni_supported()),
        "mkldnn_bf16": bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ),
    }


@functools.cache
def matmul_dtype() -> torch.dtype:
    """The dtype large dequantized-tile matmuls run in: bfloat16 where the CPU has it natively."""
    f = cpu_features()
    return torch.bfloat16 if f["mkldnn_bf16"] and (f["avx512_bf16"] or f["amx"]) else torch.float32
