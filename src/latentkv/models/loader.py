"""Checkpoint reading: safetensors (single file or sharded), memory-mapped and lazy.

Every tensor is a view into a copy-on-write mmap of its file, so opening a checkpoint reads
nothing but the headers and a model is never held twice in RAM: converting a tensor (dtype,
fp8 block dequantization, fusing) makes the only private copy. The translation from
transformers' tensor names to ours happens in named steps in `models/weights.py`.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from latentkv import fs

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_HEADER_DEPTH = 8  # a safetensors header nests 3 deep (name -> entry -> shape)
GGUF_POINTER = "latentkv-gguf.json"  # in a folder that stands for a GGUF (models/gguf_view.py)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, with the file and the reason."""


class _SafetensorsFile:
    """One .safetensors file: its parsed header and a copy-on-write mmap of the data."""

    def __init__(self, path: Path):
        self.path = path
        try:  # a directory, FIFO or device: refused, never opened (a FIFO would block)
            fh = os.fdopen(fs.open_regular(path, os.O_RDONLY, "reading the checkpoint"), "rb")
        except fs.DiskError as exc:
            raise CheckpointError(str(exc)) from None
        with fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {header_len} is implausible")
            self.header_bytes = fh.read(header_len)
            size = fh.seek(0, 2)
            if len(self.header_bytes) < header_len:
                raise CheckpointError(f"{path}: header runs past the end of the file (truncated?)")
            try:
                header = fs.load_json(self.header_bytes, MAX_HEADER_DEPTH)
            except ValueError as exc:
                raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
            if not isinstance(header, dict):
                raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, dict] = header
        self.data_start = 8 + header_len
        for name, entry in header.items():
            self._check_entry(name, entry, size)

    def _check_entry(self, name: str, entry: object, size: int) -> None:
        """Refuse an entry whose dtype, shape or byte span is not self-consistent."""
        where = f"{self.path}: tensor {name}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{where} lacks dtype, shape or data_offsets")
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where} has unsupported dtype {entry['dtype']}")
        offsets, shape = entry["data_offsets"], entry["shape"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where} has malformed data_offsets {offsets!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where} has malformed shape {shape!r}")
        start, end = offsets
        if start > end or self.data_start + end > size:
            raise CheckpointError(f"{where} lies outside the file (truncated?)")
        itemsize = torch.empty(0, dtype=SAFETENSORS_DTYPES[entry["dtype"]]).element_size()
        if (end - start) != math.prod(shape) * itemsize:
            raise CheckpointError(
                f"{where} spans {end - start} bytes but shape {shape} x {entry['dtype']} needs "
                f"{math.prod(shape) * itemsize}"
            )

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        start, end = entry["data_offsets"]
        shape = entry["shape"]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(
            self._mm, dtype=torch.uint8, count=end - start, offset=self.data_start + start
        )
        if sys.byteorder != "little":  # safetensors is little-endian; so is every machine we target
            raise CheckpointError("big-endian hosts are not supported")
        return flat.view(dtype).view(shape)


def has_weights(directory: str | Path) -> bool:
    """Whether a folder holds weights: a shard index or any .safetensors file, or a GGUF's."""
    d = Path(directory)
    return any((d / n).exists() for n in ("model.safetensors.index.json", GGUF_POINTER)) or any(
        d.glob("*.safetensors")
    )


class Checkpoint:
    """Named tensors of a model directory, read lazily. `get` returns an mmap-backed view.

    A folder that stands for a GGUF file (models/gguf_view.py) reads the GGUF behind it: its
    float tensors by name, and its quantized matrices' pieces (`NAME.int4.nibbles`, ...) too."""

    def __init__(self, directory: str | Path, progress: bool = False):
        self.directory = Path(directory)
        self._gguf = None
        if (self.directory / GGUF_POINTER).exists():
            self._open_gguf()
            return
        files = self._shard_files()
        self._files: list[_SafetensorsFile] = []
        self._where: dict[str, _SafetensorsFile] = {}
        iterator = files
        if progress and len(files) > 1:
            from latentkv.progress import progress as show_progress

            iterator = show_progress(files, "opening shards", "shard")
        for path in iterator:
            shard = _SafetensorsFile(path)
            self._files.append(shard)
            for name in shard.entries:
                if name in self._where:
                    raise CheckpointError(
                        f"tensor {name} appears in both {self._where[name].path} and {path}"
                    )
                self._where[name] = shard

    def _open_gguf(self) -> None:
        from latentkv.config import ConfigError, read_json_object
        from latentkv.models.gguf import GgufError, open_view

        try:
            pointer = read_json_object(self.directory / GGUF_POINTER)
            cfg = read_json_object(self.directory / "config.json")
            self._gguf = open_view(pointer, cfg, self.directory)
        except (GgufError, ConfigError) as exc:
            raise CheckpointError(str(exc)) from None
        self._files = [self._gguf]
        self._where = dict.fromkeys(self._gguf.entries, self._gguf)

    @property
    def gguf(self):
        """The GgufSource behind a GGUF's folder (its re-quantization report), else None."""
        return self._gguf

    def _shard_files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            from latentkv.config import ConfigError, read_json_object

            try:
                weight_map = read_json_object(index).get("weight_map")
            except ConfigError as exc:
                raise CheckpointError(str(exc)) from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(
                    f"{index}: unreadable shard index (weight_map must map tensor names to shard files)"
                )
            if bad := [n for n in weight_map.values() if Path(n).name != n]:
                raise CheckpointError(f"{index}: shard names must be file names in the folder: {bad[:3]}")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.directory / n).exists()]
            if missing:
                raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
            return [self.directory / n for n in names]
        single = self.directory / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.directory.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"no safetensors weights in {self.directory}")
        return found

    def __contains__(self, name: str) -> bool:
        return name in self._where or (self._gguf is not None and self._gguf.has_piece(name))

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> list[int]:
        return list(self._where[name].entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name ("F32", "BF16", "F8_E4M3", ...)."""
        return self._where[name].entries[name].get("dtype", "F32")  # a GGUF's: floats on reading

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where and not (self._gguf is not None and self._gguf.has_piece(name)):
            raise CheckpointError(f"checkpoint in {self.directory} has no tensor {name!r}")
        return (self._where.get(name) or self._gguf).tensor(name)

    def fingerprint(self) -> str:
        """SHA-256 over every shard's safetensors header: names, dtypes, shapes and offsets."""
        digest = hashlib.sha256()
        for shard in self._files:
            digest.update(shard.header_bytes)
        return digest.hexdigest()


def own_pages(tensors) -> int:
    """Make the pages under `tensors` (views of a checkpoint's copy-on-write mmap) the process's
    own: one byte of every page is written back unchanged, so the kernel gives each page a private
    anonymous copy. Until then a view's pages are page cache, which the kernel may drop under a
    memory limit and read from disk again on the next pass (a streamed model's dense weights,
    kept beside an expert cache at the limit, must not be). No allocation: the heap does not grow.
    Returns the bytes owned (each storage once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or not storage.nbytes():
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        raw[:: mmap.PAGESIZE].mul_(1)
        raw[-1:].mul_(1)  # the last page, where the stride stops short of it
        total += storage.nbytes()
    return total


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """An fp8 weight with one inverse scale per (block_out x block_in) tile, as float32.

    DeepSeek-V3 / GLM-5 fp8 checkpoints store `w_fp8 = w / s` per 128x128 tile and
    `weight_scale_inv = s`; the last tiles may be partial.
    """
    out_dim, in_dim = weight.shape
    bo, bi = block
    need = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != need:
        raise CheckpointError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {need} for a "
            f"{out_dim}x{in_dim} weight in {bo}x{bi} blocks"
        )
    scales = scale_inv.float().repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
    return weight.float() * scales
