"""int4 weights on a CUDA device: torch's CUDA int4 op (`_weight_int4pack_mm`, tinygemm).

The same weight as `int4.py` (group-wise, W~ = (q - 8) * scale + zero, scale and zero bfloat16 in
`scale_zeros` [in / G, out, 2], which the CUDA op shares with the CPU one), in the CUDA op's own
packed layout, made at load from the portable nibbles a file stores:

    portable (int4.pack_nibbles)   byte j of a row: column 2j in the low nibble, 2j + 1 in the high
    the CUDA packing op's input    byte j of a row: column 2j in the HIGH nibble, 2j + 1 in the low
    `_convert_weight_to_int4pack(that, inner_k_tiles)` -> int32 [out / 8, in / (16 t), 32, t / 2]

so `cuda_nibbles` swaps each byte's nibbles (a CPU-testable function) and the op does the rest
on the device. Reading a weight back (`portable_cuda`) finds where each nibble went by packing
probes, as `int4._op_positions` does for the CPU layout. Everything but `cuda_nibbles` and
`inner_k_tiles` needs a CUDA device; no test here has one (tests/weights/test_int4_cuda.py skips
them with that reason), and `benchmarks/gpu_check.py` checks them on a GPU.
"""

from __future__ import annotations

import functools

import torch

INNER_K_TILES = (8, 4, 2)  # the op's inner K tiles, widest first: K must be a multiple of 16 t


def cuda_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Portable nibbles uint8 [N, K / 2] -> the CUDA packing op's input (nibbles of each byte swapped)."""
    return (nibbles << 4) | (nibbles >> 4)


def inner_k_tiles(in_features: int) -> int:
    """The widest inner K tiling the CUDA op takes for `in_features` (padded) columns."""
    for tiles in INNER_K_TILES:
        if in_features % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"the CUDA int4 op needs a multiple of 32 input columns, got {in_features}")


def pack_cuda(nibbles: torch.Tensor) -> torch.Tensor:
    """Portable nibbles uint8 [N, K / 2] on a CUDA device -> the op's packed int32 layout."""
    return torch.ops.aten._convert_weight_to_int4pack(
        cuda_nibbles(nibbles), inner_k_tiles(2 * nibbles.shape[1])
    )


def matmul_cuda(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zeros: torch.Tensor
) -> torch.Tensor:
    """x bfloat16 [M, K] -> float32 [M, N] = x W~^T through the CUDA op."""
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scale_zeros).float()


def portable_cuda(packed: torch.Tensor, out_padded: int, in_padded: int) -> torch.Tensor:
    """The op's packed layout -> portable nibbles uint8 [out_padded, in_padded / 2] (on the CPU)."""
    flat = _flat_nibbles(packed)
    q = torch.empty(out_padded * in_padded, dtype=torch.uint8)
    q[_positions(out_padded, in_padded, str(packed.device))] = flat
    pairs = q.view(out_padded, in_padded // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _flat_nibbles(packed: torch.Tensor) -> torch.Tensor:
    raw = packed.contiguous().view(torch.uint8).cpu().flatten()
    return torch.stack([raw & 15, raw >> 4], dim=-1).flatten()


@functools.lru_cache(maxsize=16)
def _positions(out_f: int, in_f: int, device: str) -> torch.Tensor:
    """For each nibble of the op's layout, the flat index (o * in + i) of the weight it holds:
    probes whose values are the hex digits of each element's index, packed by the op."""
    n = out_f * in_f
    where = torch.zeros(n, dtype=torch.int64)
    index = torch.arange(n, dtype=torch.int64)
    for digit in range(max(1, -(-(n - 1).bit_length() // 4))):
        probe = ((index >> (4 * digit)) & 15).to(torch.uint8).view(out_f, in_f // 2, 2)
        nibbles = (probe[..., 0] | (probe[..., 1] << 4)).to(device)
        where |= _flat_nibbles(pack_cuda(nibbles)).to(torch.int64) << (4 * digit)
    return where
