"""latentkv's own CPU decode kernels, built on first use: int8 and int4 weights (decode.cpp), a
few rows of small bfloat16 matrices and experts (bf16.cpp; experts.cpp holds the expert shapes
every format shares), decode attention over packed KV rows (attention.cpp, run by
`latentkv.attention.native`), and the block KV codecs' encoder (kv_blocks.cpp: q8_0, q4_0, q8s, q4s, called by kv/codecs/blocks.py).

    k = native.kernels()        # None where they cannot be built here (then torch's ops serve)
    y = k.int8_mm(x, q, scale)                                   # x f32 [M, K] -> f32 [M, N]
    y = k.int4_mm(x, packed, scale_zeros, group, out, residual)  # residual + x @ W~^T
    o = k.mla_decode(query, c, r, index, c_format, r_format, n_r)  # one token's MLA context

A decode step multiplies one row (or a batch's few) by every matrix: it is bound by the bytes
it reads. torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` read int8 and int4 at
well under the machine's memory bandwidth (docs/weights.md); these kernels stream each matrix
once, widen every weight in registers and multiply it by every row of x, with the residual add
folded in: float32 x and sums on AVX2 and plain C++; on AVX-512 VNNI exact integer products
with x quantized per group (int16 for int8 weights, int8 for int4 weights, decode.cpp).

Built once per machine: the C++ sources are compiled with the system's C++ compiler against the
installed torch (no ninja, no network) into the cache directory (`config.cache_root()/kernels`,
keyed by a hash of the source, flags, compiler and torch version), then loaded as torch ops
(`torch.ops.latentkv.*`). Where no compiler is found or the build fails, `kernels()` is None,
`unavailable()` says why, and the formats use torch's ops as before.

The vector path (AVX-512 VNNI, AVX-512, AVX2 or plain C++) is chosen once per process from torch's own CPU
capability (`torch.backends.cpu.get_cpu_capability()`, which honours ATEN_CPU_CAPABILITY), so a
run capped to AVX2 or to plain code by torch runs these kernels the same way.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from latentkv.config import cache_root

HERE = Path(__file__).parent
SOURCES = (
    HERE / "decode.cpp",
    HERE / "bf16.cpp",
    HERE / "experts.cpp",
    HERE / "attention.cpp",
    HERE / "kv_blocks.cpp",
)  # one library
HEADERS = (HERE / "native.h", HERE / "ops.h")
# torch's capability -> the kernels' best path there (a CPU without AVX512-VNNI and VBMI runs 2)
ISA = {"AVX512": 3, "AVX2": 1, "DEFAULT": 0}
ISA_NAMES = {4: "AVX-512 VNNI", 3: "AVX-512 VNNI", 2: "AVX-512", 1: "AVX2", 0: "plain C++"}
# what each path quantizes the activations to (the float paths read them as they are)
ACTIVATIONS = {4: "int8", 3: "int16", 2: "f32", 1: "f32", 0: "f32"}
COMPILERS = ("g++", "c++", "clang++")


@dataclass(frozen=True)
class Kernels:
    """The loaded kernels and the vector paths this process runs them with: `isa` for int8
    matrices, `isa4` for int4 ones. They differ on AVX-512 VNNI only: int4 reads x quantized to
    int8 (path 4: no widening of the nibbles, within what llama.cpp's q8 activations cost and far
    below int4's own rounding), int8 keeps int16 x (path 3: int8 x would cost 3x int8's own
    rounding for little speed; docs/weights.md)."""

    isa: int
    isa4: int

    @property
    def name(self) -> str:
        return ISA_NAMES[self.isa]

    def int8_mm(
        self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x f32 [M, K] (K <= q's columns), q int8 [N, ldq], scale bf16 [N] -> [M, N] f32:
        (x @ q[:, :K]^T) * scale (+ residual [M, N])."""
        return torch.ops.latentkv.int8_mm(x, q, scale, residual, self.isa)

    def bf16_mm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x f32 [M <= 4, K], w bf16 [N, K] contiguous -> [M, N] f32: x @ w^T (+ residual), w
        widened to float32, float32 products and sums (bf16.cpp)."""
        return torch.ops.latentkv.bf16_mm(x, w, residual, self.isa)

    def int4_mm(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale_zeros: torch.Tensor,
        group_size: int,
        out_features: int,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x f32 [M, K] (K <= Kp), packed uint8 [Np, Kp / 2] in `int4.KERNEL_LAYOUT`,
        scale_zeros bf16 [Kp / G, Np, 2] -> [M, out_features] f32 (+ residual)."""
        return torch.ops.latentkv.int4_mm(
            x, packed, scale_zeros, group_size, out_features, residual, self.isa4
        )

    def expert_int8(self, x, gate_up, down, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A SwiGLU expert in one call: down(silu(gate(x)) * up(x)) (+ residual), gate_up and
        down `Int8Linear`s (gate rows first)."""
        return torch.ops.latentkv.expert_int8(
            x, gate_up.q, gate_up.scale, down.q, down.scale, residual, self.isa
        )

    def expert_bf16(self, x, gate_up, down, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The same with `Bf16Linear`s (contiguous weights; up to 4 rows of x: bf16.cpp)."""
        return torch.ops.latentkv.expert_bf16(x, gate_up.weight, down.weight, residual, self.isa)

    def expert_int4(self, x, gate_up, down, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The same with `Int4Linear`s of one group size."""
        return torch.ops.latentkv.expert_int4(
            x,
            gate_up.packed,
            gate_up.scale_zeros,
            gate_up.out_features,
            down.packed,
            down.scale_zeros,
            down.out_features,
            gate_up.group_size,
            residual,
            self.isa4,
        )

    def mla_decode(
        self,
        query: torch.Tensor,
        c: torch.Tensor,
        r: torch.Tensor,
        index: torch.Tensor | None,
        c_format: tuple[int, int],
        r_format: tuple[int, int],
        n_r: int,
    ) -> torch.Tensor:
        """One decode token's attention over packed KV rows (attention.cpp): query f32 [H, n_c +
        n_r] (scaled), c / r uint8 [T, bytes] as their codecs store them, each format a pair
        (ROW_FORMATS code, block); over the rows at `index` [K] int64 when given -> [H, n_c].
        AVX2 (`isa` 1) or AVX-512 (2 and up)."""
        return torch.ops.latentkv.mla_decode(query, c, r, index, *c_format, n_r, *r_format, self.isa)


# attention.cpp's row formats: the bytes of a bf16 row, of q8_0 blocks (q8s's too), of q4_0 ones (q4s's)
ROW_FORMATS = {"bf16": 0, "q8_0": 1, "q4_0": 2}
# kv_blocks.cpp's encoders, by codec name (q8_0 and q8s write 8-bit blocks, the others 4-bit ones)
ENCODE_KINDS = {"q8_0": 0, "q4_0": 1, "q8s": 2, "q4s": 3}


def isa_for(capability: str) -> int:
    """The kernels' vector path for one of torch's CPU capabilities (unknown: plain C++)."""
    return ISA.get(capability.upper(), 0)


_UNRESOLVED = object()
_KERNELS: Kernels | None | object = _UNRESOLVED  # what kernels() returns, once it has been asked


def kernels() -> Kernels | None:
    """The kernels with this process's vector path, building them on first use; None where they
    cannot be built or loaded here (see `unavailable`).

    After the first call this reads a plain module global, so a decode step that torch.compile
    traces (which asks for the kernels on every step: the attention backend, the block encoder)
    sees a constant, not the build check underneath (its file-system calls would break the graph)."""
    global _KERNELS
    if _KERNELS is _UNRESOLVED:
        _KERNELS = _resolve()
    return _KERNELS


def _resolve() -> Kernels | None:
    if _load() is not None:
        return None
    isa = isa_for(torch.backends.cpu.get_cpu_capability())
    while isa > 0 and not torch.ops.latentkv.has_isa(isa):  # torch's capability, but not the CPU's
        isa -= 1
    return Kernels(isa, 4 if isa == 3 else isa)


def unavailable() -> str | None:
    """Why `kernels()` is None (one line), or None when they are loaded."""
    return _load()


def with_isa(isa: int) -> Kernels | None:
    """The kernels on a given vector path for both formats, where this CPU runs it (tests and
    benchmarks compare the paths)."""
    if _load() is not None or not torch.ops.latentkv.has_isa(isa):
        return None
    return Kernels(isa, isa)


@functools.cache
def _load() -> str | None:
    """Build (once per machine) and load the library; the reason it failed, or None."""
    try:
        path = _build()
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    _register_fakes()
    return None


def _compiler() -> str:
    for name in COMPILERS:
        if path := shutil.which(name):
            return path
    raise OSError(f"no C++ compiler ({', '.join(COMPILERS)}) on PATH")


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        cxx,
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-ffp-contract=off",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
    ]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [
        *map(str, SOURCES),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
        "-o",
        str(out),
    ]
    return cmd


def _build() -> Path:
    """The library's path in the cache, compiled there first if it is not (one process at a time)."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in (
        *(p.read_bytes() for p in SOURCES + HEADERS),
        " ".join(_command(cxx, Path("OUT"))).encode(),
        version.encode(),
    ):
        key.update(part)
    key.update(torch.__version__.encode())
    folder = cache_root() / "kernels"
    out = folder / f"latentkv_decode-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if out.exists():
            return out
        print("building latentkv's CPU kernels (once per machine)...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            part = Path(tmp) / out.name
            done = subprocess.run(_command(cxx, part), capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line]
                raise OSError(
                    f"{Path(cxx).name} failed ({done.returncode}): {(errors or [done.stderr.strip()])[0][-2000:]}"
                )
            os.replace(part, out)
    return out


def _register_fakes() -> None:
    """Shapes for tracing (torch.compile sees the ops as opaque calls with these outputs)."""

    @torch.library.register_fake("latentkv::int8_mm")
    def _int8(x, q, scale, residual, isa):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("latentkv::bf16_mm")
    def _bf16(x, w, residual, isa):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("latentkv::expert_bf16")
    def _expert16(x, gate_up, down, residual, isa):
        return x.new_empty(x.shape[0], down.shape[0])

    @torch.library.register_fake("latentkv::moe_bf16")
    def _moe16(x, idx, weights, gate_up, down, by_id, isa):
        return x.new_empty(x.shape[0], down.shape[1])

    @torch.library.register_fake("latentkv::int4_mm")
    def _int4(x, packed, scale_zeros, group_size, out_features, residual, isa):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("latentkv::expert_int8")
    def _expert8(x, gu_q, gu_scale, dn_q, dn_scale, residual, isa):
        return x.new_empty(x.shape[0], dn_q.shape[0])

    @torch.library.register_fake("latentkv::moe_int8")
    def _moe8(x, idx, weights, gu_q, gu_scale, dn_q, dn_scale, by_id, isa):
        return x.new_empty(x.shape[0], dn_q.shape[1])

    @torch.library.register_fake("latentkv::moe_int4")
    def _moe4(x, idx, weights, gu, gu_sz, gu_rows, dn, dn_sz, dn_rows, group_size, by_id, isa):
        return x.new_empty(x.shape[0], dn_rows)

    @torch.library.register_fake("latentkv::mla_decode")
    def _mla(query, c, r, index, fmt_c, block_c, n_r, fmt_r, block_r, isa):
        return query.new_empty(query.shape[0], query.shape[1] - n_r)

    @torch.library.register_fake("latentkv::encode_blocks")
    def _encode(x, kind, block):
        eight_bit = kind in (ENCODE_KINDS["q8_0"], ENCODE_KINDS["q8s"])
        per_block = 2 + (block if eight_bit else block // 2)
        return x.new_empty(x.shape[0], x.shape[1] // block * per_block, dtype=torch.uint8)

    @torch.library.register_fake("latentkv::heads_int8")
    def _heads8(x, q, scale, isa):
        return x.new_empty(x.shape[0], x.shape[1], q.shape[1])

    @torch.library.register_fake("latentkv::heads_int4")
    def _heads4(x, packed, scale_zeros, group_size, out_features, isa):
        return x.new_empty(x.shape[0], x.shape[1], out_features)

    @torch.library.register_fake("latentkv::expert_int4")
    def _expert4(x, gu_packed, gu_sz, gu_rows, dn_packed, dn_sz, dn_rows, group_size, residual, isa):
        return x.new_empty(x.shape[0], dn_rows)
