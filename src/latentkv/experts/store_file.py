"""The expert store on disk at the byte level: layer files of aligned extents and a manifest
(stdlib, plus the xxhash package for the default checksum; the spec is
docs/expert-file-format.md).

    DIR/manifest.json       what every extent holds and where (written last, atomically)
    DIR/layer-LLLL.lkx      4 KiB header block, then one extent per expert of layer L:
                            expert e at 4096 + e * stride, `length` payload bytes, zero-padded
                            to `stride` (a 4 KiB multiple)

An extent is one expert: its gate, up and down weights (and their scales) as raw tensors, each
at a 64-byte aligned offset inside it. One pread (O_DIRECT-able) brings one expert. Each
extent's check is H(seed, "expert", u32 layer, u32 expert, payload) in 16 bytes, H the
manifest's `checksum` (XXH3-128 by default, SHA-256 in stores written before 1.1), where the
seed binds it to the model fingerprint, so a flipped bit, a truncated file, an extent of another
layer or of another model is refused with the expert's name and never computed on.

The writer holds one expert at a time and writes each layer file under a temporary name; once
every layer is written and fsynced it drops the old manifest (if any), renames the layer files
into place and publishes the manifest last (temp file, fsync, rename, fsync the folder). So an
interrupted conversion leaves either the old store, intact, or no manifest (refused, never
misread), and a failed one (a full disk, a read-only one) removes every file it wrote. All file
access goes through `latentkv.fs`.

The manifest is untrusted input: at most MAX_MANIFEST_BYTES, nested at most MAX_JSON_DEPTH
deep, and every count and size bounded (layers, experts, tensors, dims, extent bytes) before
anything is sized from it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from latentkv import fs

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]

MAGIC = b"\x89LKX\r\n\x1a\n"  # PNG-style, like the KV file: catches text-mode damage
FORMAT = "latentkv-experts"
FORMAT_MAJOR = 1  # a full store; a reader refuses any major version it does not know
FORMAT_MINOR = 1  # minor versions only add manifest keys or values (1.1: the xxh3-128 checksum)
# A share (one rank's experts of a cluster, docs/distributed.md) holds some experts of each layer,
# listed by id: major 2, so a reader that knows only 1.x refuses it instead of misplacing extents.
SHARE_MAJOR = 2
KNOWN_MAJORS = (FORMAT_MAJOR, SHARE_MAJOR)
ALIGN = 4096  # extents start and end on 4 KiB boundaries (O_DIRECT-able on every common disk)
TENSOR_ALIGN = 64  # tensors inside an extent start on 64-byte boundaries (SIMD loads)
CHECK_BYTES = 16
DEFAULT_CHECKSUM = "xxh3-128"  # the extent check new stores use (`CHECKSUMS`)
MANIFEST = "manifest.json"
LAYER_HEADER = struct.Struct("<8sHHII32s")  # magic, major, minor, layer, experts, seed
# Element sizes of the dtypes a tensor may have (numpy-style names, so any reader can map them).
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
}
# Bounds on a manifest (untrusted): far past any real model (DeepSeek-V3: 58 MoE layers of 256
# experts of 3 tensors, 44 MB each in f32), small enough that nothing sized from them overflows.
MAX_MANIFEST_BYTES = 256 << 20
MAX_JSON_DEPTH = 16  # the manifest nests 6 deep
MAX_LAYERS = 1 << 13
MAX_EXPERTS = 1 << 16
MAX_TENSORS = 64
MAX_DIMS = 8
MAX_EXTENT_BYTES = 1 << 34


class ExpertFileError(ValueError):
    """The expert store cannot be used: a damaged or foreign manifest or layer file."""


class ExpertDamaged(ExpertFileError):
    """One expert's extent fails its check (bit flip, truncation, another model's bytes)."""


class ExpertUnreadable(ExpertFileError):
    """An expert's layer file cannot be read: missing, not a regular file, an I/O error, or a
    header of another layer or model (the message names the expert and says why)."""


@dataclass(frozen=True)
class TensorSpec:
    """One raw tensor inside an extent: bytes [offset, offset + nbytes) of the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ExtentLayout:
    """Where each tensor sits inside one expert's extent (the same for every expert of a layer).

    `meta` is opaque here: the torch side records how the tensors make Linear objects."""

    tensors: tuple[TensorSpec, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def pack(cls, tensors: list[tuple[str, str, tuple[int, ...]]], meta: dict | None = None) -> ExtentLayout:
        """(name, dtype, shape) in order -> a layout with 64-byte aligned offsets."""
        specs, offset = [], 0
        for name, dtype, shape in tensors:
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"tensor {name}: dtype {dtype!r} not in {sorted(DTYPE_BYTES)}")
            spec = TensorSpec(name, dtype, tuple(int(d) for d in shape), offset)
            specs.append(spec)
            offset = _round_up(offset + spec.nbytes, TENSOR_ALIGN)
        return cls(tuple(specs), dict(meta or {}))

    @property
    def length(self) -> int:
        """Payload bytes of one extent (the last tensor's end)."""
        last = self.tensors[-1]
        return last.offset + last.nbytes if self.tensors else 0

    @property
    def stride(self) -> int:
        """Bytes one extent takes in the file (the payload padded to a 4 KiB multiple)."""
        return max(ALIGN, _round_up(self.length, ALIGN))

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor {name!r} in this extent; it holds {[t.name for t in self.tensors]}")

    def to_json(self) -> dict:
        return {
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset}
                for t in self.tensors
            ],
            "length": self.length,
            "stride": self.stride,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict) -> ExtentLayout:
        tensors = d["tensors"]
        if not isinstance(tensors, list) or not 0 < len(tensors) <= MAX_TENSORS:
            raise ExpertFileError(f"a layout needs 1 to {MAX_TENSORS} tensors")
        specs = tuple(TensorSpec(t["name"], t["dtype"], _shape(t["shape"]), t["offset"]) for t in tensors)
        layout = cls(specs, d.get("meta", {}))
        layout.validate(d.get("length"), d.get("stride"))
        return layout

    def validate(self, length: int | None = None, stride: int | None = None) -> None:
        end = 0
        for t in self.tensors:
            if (
                t.dtype not in DTYPE_BYTES
                or not _is_int(t.offset)
                or t.offset % TENSOR_ALIGN
                or not end <= t.offset <= MAX_EXTENT_BYTES
            ):
                raise ExpertFileError(f"tensor {t.name}: bad dtype or offset ({t.dtype}, {t.offset})")
            if any(not _is_int(d) or d < 0 for d in t.shape):
                raise ExpertFileError(f"tensor {t.name}: bad shape {t.shape}")
            end = t.offset + t.nbytes
            if end > MAX_EXTENT_BYTES:
                raise ExpertFileError(f"tensor {t.name}: {end} bytes is beyond any expert")
        if (length, stride) != (None, None) and (length, stride) != (self.length, self.stride):
            raise ExpertFileError(
                f"layout says {length}/{stride} bytes, its tensors make {self.length}/{self.stride}"
            )


@dataclass(frozen=True)
class LayerEntry:
    """One layer file: its experts' layout and one check per extent. A full store's file holds
    experts 0..E-1 in order; a share's holds the experts `ids` (ascending) of the layer's `total`."""

    layer: int
    file: str
    layout: ExtentLayout
    checks: tuple[str, ...]  # hex, one per extent in the file
    ids: tuple[int, ...] | None = None  # a share: the expert id of each extent; None: 0..len(checks)-1
    total: int | None = None  # a share: the layer's experts in the model

    @property
    def n_experts(self) -> int:
        """The layer's experts in the model (a share holds some of them)."""
        return len(self.checks) if self.ids is None else int(self.total or 0)

    @property
    def held(self) -> tuple[int, ...]:
        """The experts this file holds, in file order."""
        return tuple(range(len(self.checks))) if self.ids is None else self.ids

    def holds(self, expert: int) -> bool:
        if self.ids is None:
            return 0 <= expert < len(self.checks)
        return expert in self._slots

    @property
    def _slots(self) -> dict[int, int]:
        slots = self.__dict__.get("_slot_map")
        if slots is None:
            slots = {e: i for i, e in enumerate(self.ids or ())}
            object.__setattr__(self, "_slot_map", slots)
        return slots

    def slot(self, expert: int) -> int:
        """The extent index of `expert` in the file; KeyError if the file does not hold it."""
        if self.ids is None:
            if not 0 <= expert < len(self.checks):
                raise KeyError(expert)
            return expert
        return self._slots[expert]

    def check(self, expert: int) -> str:
        return self.checks[self.slot(expert)]

    def offset(self, expert: int) -> int:
        return ALIGN + self.slot(expert) * self.layout.stride

    @property
    def file_bytes(self) -> int:
        return ALIGN + len(self.checks) * self.layout.stride

    def to_json(self) -> dict:
        d = {
            "layer": self.layer,
            "file": self.file,
            "experts": len(self.checks),
            "offsets": [ALIGN + i * self.layout.stride for i in range(len(self.checks))],
            "checks": list(self.checks),
            "layout": self.layout.to_json(),
        }
        if self.ids is not None:
            d.update(ids=list(self.ids), total=self.total)
        return d

    @classmethod
    def from_json(cls, d: dict) -> LayerEntry:
        layer, checks, ids, total = d["layer"], d["checks"], d.get("ids"), d.get("total")
        if not _is_int(layer) or not 0 <= layer < MAX_LAYERS:
            raise ExpertFileError(f"layer index {layer!r:.40} is not in 0..{MAX_LAYERS - 1}")
        if not isinstance(checks, list) or len(checks) > MAX_EXPERTS:
            raise ExpertFileError(f"layer {layer}: at most {MAX_EXPERTS} expert checks, got {len(checks)}")
        if not all(isinstance(c, str) and len(c) == 2 * CHECK_BYTES for c in checks):
            raise ExpertFileError(f"layer {layer}: an expert check is not {2 * CHECK_BYTES} hex digits")
        if ids is not None and (
            not isinstance(ids, list)
            or not all(_is_int(e) for e in ids)
            or not _is_int(total)
            or not 0 <= total <= MAX_EXPERTS
        ):
            raise ExpertFileError(
                f"layer {layer}: a share's ids and total must be integers up to {MAX_EXPERTS}"
            )
        entry = cls(
            layer,
            str(d["file"]),
            ExtentLayout.from_json(d["layout"]),
            tuple(checks),
            None if ids is None else tuple(ids),
            None if ids is None else total,
        )
        if Path(entry.file).name != entry.file or not entry.file.endswith(".lkx"):
            raise ExpertFileError(f"layer {entry.layer}: file name {entry.file!r} is not a plain .lkx name")
        n = len(entry.checks)
        expected = [ALIGN + i * entry.layout.stride for i in range(n)]
        if d.get("experts") != n or d.get("offsets") != expected:
            raise ExpertFileError(f"layer {entry.layer}: expert count or offsets disagree with the layout")
        if entry.ids is not None and (
            len(entry.ids) != n
            or list(entry.ids) != sorted(set(entry.ids))
            or (entry.ids and not 0 <= entry.ids[0] <= entry.ids[-1] < (entry.total or 0))
        ):
            raise ExpertFileError(
                f"layer {entry.layer}: its expert ids are not {n} distinct ascending ids below {entry.total}"
            )
        return entry


@dataclass(frozen=True)
class Manifest:
    """The expert store of one model: its fingerprint and every MoE layer's file."""

    fingerprint: str
    layers: dict[int, LayerEntry]
    meta: dict = field(default_factory=dict)
    minor: int = FORMAT_MINOR
    checksum: str = DEFAULT_CHECKSUM

    @property
    def expert_bytes(self) -> int:
        """Payload bytes of every expert this store holds (a share: its experts only)."""
        return sum(e.layout.length * len(e.checks) for e in self.layers.values())

    @property
    def is_share(self) -> bool:
        """True for one rank's share of a cluster's experts (some experts of each layer)."""
        return any(e.ids is not None for e in self.layers.values())

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": [SHARE_MAJOR, 0] if self.is_share else [FORMAT_MAJOR, self.minor],
            "fingerprint": self.fingerprint,
            "checksum": self.checksum,
            "alignment": ALIGN,
            "meta": self.meta,
            "layers": [self.layers[i].to_json() for i in sorted(self.layers)],
        }

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        if d.get("format") != FORMAT:
            raise ExpertFileError(f"not a latentkv expert store (format {d.get('format')!r})")
        major, minor = d.get("version", [0, 0])
        if major not in KNOWN_MAJORS:
            raise ExpertFileError(
                f"expert store format version {major}.{minor}; this latentkv reads "
                f"{' and '.join(f'{m}.x' for m in KNOWN_MAJORS)}: convert the model again or upgrade latentkv"
            )
        if d.get("checksum") not in CHECKSUMS or d.get("alignment") != ALIGN:
            raise ExpertFileError(
                f"unknown checksum {d.get('checksum')!r} or alignment {d.get('alignment')!r} in the manifest"
            )
        layers = {}
        if not isinstance(d["layers"], list) or len(d["layers"]) > MAX_LAYERS:
            raise ExpertFileError(f"the manifest's layers must be a list of at most {MAX_LAYERS}")
        for raw in d["layers"]:
            entry = LayerEntry.from_json(raw)
            if entry.layer in layers:
                raise ExpertFileError(f"layer {entry.layer} appears twice in the manifest")
            layers[entry.layer] = entry
        manifest = cls(str(d["fingerprint"]), layers, dict(d.get("meta", {})), int(minor), d["checksum"])
        if manifest.is_share != (major == SHARE_MAJOR):
            raise ExpertFileError(
                f"version {major}.{minor} manifest {'without' if major == SHARE_MAJOR else 'with'} expert ids: "
                "a share lists its experts and is version 2, a full store is version 1"
            )
        return manifest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise ExpertFileError(f"a tensor shape must be a list of at most {MAX_DIMS} sizes")
    return tuple(value)


def expert_name(layer: int, expert: int) -> str:
    """The checkpoint's name for an expert (what errors say)."""
    return f"model.layers.{layer}.mlp.experts.{expert}"


def seed_for(fingerprint: str) -> bytes:
    return hashlib.sha256(b"latentkv experts\0" + fingerprint.encode()).digest()


def _xxh3_128():
    try:
        import xxhash
    except ImportError:
        raise ExpertFileError(
            "this expert store is checked with XXH3-128: install the xxhash package (pip install xxhash)"
        ) from None
    return xxhash.xxh3_128()


# The extent checks a manifest may name. XXH3-128 is the default: ~15 GB/s against SHA-256's
# ~1.4 (a 21 MB expert: 1.4 ms against 15 ms of CPU on every read) and, like it, catches any
# flipped bit, truncation or misplaced extent; the checks guard against damage, not forgery.
CHECKSUMS = {"sha256-128": hashlib.sha256, "xxh3-128": _xxh3_128}


def extent_check(
    seed: bytes, layer: int, expert: int, payload: bytes | memoryview, checksum: str = DEFAULT_CHECKSUM
) -> str:
    h = CHECKSUMS[checksum]()
    h.update(seed)
    h.update(b"expert")
    h.update(struct.pack("<II", layer, expert))
    h.update(payload)
    return h.digest()[:CHECK_BYTES].hex()


def layer_file_name(layer: int) -> str:
    return f"layer-{layer:04d}.lkx"


# --- manifest bytes ----------------------------------------------------------------------------


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_bytes(manifest: Manifest) -> bytes:
    body = manifest.to_json()
    check = hashlib.sha256(_canonical(body)).hexdigest()
    return json.dumps({"manifest": body, "sha256": check}, sort_keys=True, indent=1).encode() + b"\n"


def read_manifest(directory: str | Path, fingerprint: str | None = None) -> Manifest:
    """Parse and verify DIR/manifest.json; a fingerprint that differs from `fingerprint` is refused."""
    path = Path(directory) / MANIFEST
    try:
        raw = fs.read_bounded(path, MAX_MANIFEST_BYTES, "reading the expert store's manifest")
    except fs.DiskError as exc:
        if exc.errno == errno.ENOENT:
            raise ExpertFileError(
                f"{path} is missing: no expert store here (or its conversion did not finish)"
            ) from None
        raise ExpertFileError(str(exc)) from None
    try:
        outer = fs.load_json(raw, MAX_JSON_DEPTH)
        body = outer["manifest"]
        ok = hashlib.sha256(_canonical(body)).hexdigest() == outer["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ExpertFileError(f"{path} is not a readable manifest ({exc})") from None
    if not ok:
        raise ExpertFileError(f"{path} fails its checksum: the manifest is damaged")
    try:
        manifest = Manifest.from_json(body)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ExpertFileError):
            raise
        raise ExpertFileError(f"{path}: malformed manifest ({exc!r})") from None
    if fingerprint is not None and manifest.fingerprint != fingerprint:
        raise ExpertFileError(
            f"{path} belongs to another model (fingerprint {manifest.fingerprint[:16]}..., "
            f"this model is {fingerprint[:16]}...): convert this model's experts again"
        )
    return manifest


# --- writing -----------------------------------------------------------------------------------


class ExpertStoreWriter:
    """Writes an expert store layer by layer, expert by expert; `finish` publishes it.

    with ExpertStoreWriter(dir, fingerprint) as w:
        for layer in moe_layers:
            with w.layer(layer, n_experts, layout) as lw:
                for e in range(n_experts):
                    lw.write(e, [gate_bytes, gate_scale_bytes, ...])  # the layout's order
        w.finish()

    Layer files are written under temporary names and renamed into place by `finish`, so the
    store already in the folder (`replace`) stays whole until the new one is complete. Leaving
    the block without `finish` (an error) removes every file this writer wrote. One writer per
    folder at a time (an advisory lock on the folder); DiskError, one line, when the disk refuses.
    """

    DOING = "writing the expert store"

    def __init__(
        self,
        directory: str | Path,
        fingerprint: str,
        meta: dict | None = None,
        replace: bool = False,
        checksum: str = DEFAULT_CHECKSUM,
    ):
        _require_little_endian()
        if checksum not in CHECKSUMS:
            raise ValueError(f"unknown extent checksum {checksum!r}; known: {', '.join(CHECKSUMS)}")
        self.checksum = checksum
        self._made = fs.missing_parents(directory)  # folders to take back if nothing is written
        self.directory = fs.make_dirs(directory, self.DOING)
        self.replace = replace
        if os.path.lexists(self.directory / MANIFEST) and not replace:
            raise ExpertFileError(
                f"{self.directory / MANIFEST} exists: refusing to overwrite an expert store"
            )
        self._lock_fd = _lock_folder(self.directory)
        self.fingerprint = fingerprint
        self.seed = seed_for(fingerprint)
        self.meta = dict(meta or {})
        self.layers: dict[int, LayerEntry] = {}
        self.bytes_written = 0
        self._pending: list[fs.Publish] = []  # written and fsynced layer files, not yet in place

    def layer(
        self, layer: int, n_experts: int, layout: ExtentLayout, ids: tuple[int, ...] | None = None
    ) -> LayerWriter:
        """A layer file of experts 0..n_experts-1, or (a share) of the experts `ids` (ascending)
        of the layer's n_experts."""
        if layer in self.layers:
            raise ValueError(f"layer {layer} was already written")
        return LayerWriter(self, layer, n_experts, layout, ids)

    def check_space(self, need: int) -> None:
        """DiskError up front unless the folder's file system can hold `need` more bytes (the
        layer files of a store being replaced are freed only once the new ones are in place)."""
        fs.check_space(self.directory, need, f"{self.DOING} ({fs.gb(need)})")

    def finish(self) -> Manifest:
        """Put the layer files in place and publish the manifest (temp, fsync, rename, fsync the
        folder). The old manifest goes first: a crash in between leaves no manifest."""
        manifest = Manifest(self.fingerprint, dict(self.layers), self.meta, checksum=self.checksum)
        path = self.directory / MANIFEST
        placed: list[Path] = []
        try:
            if os.path.lexists(path):
                try:
                    os.unlink(path)
                except OSError as exc:
                    raise fs.error(exc, path, self.DOING) from None
                fs.sync_dir(self.directory)
            for out in self._pending:
                out.place()
                placed.append(out.path)
            fs.write_atomic(path, manifest_bytes(manifest), self.DOING)
        except BaseException:
            for written in placed:  # without a manifest they are of no use: take them back
                fs.remove(written)
            self.abort()
            raise
        self._pending.clear()
        self._unlock()
        return manifest

    def abort(self) -> None:
        """Remove every layer file written and not yet in place (what leaving the block without
        `finish` does); the folder's existing store, if any, is left as it was."""
        for out in self._pending:
            out.abort()
        self._pending.clear()
        self._unlock()
        if not (self.directory / MANIFEST).exists():
            fs.remove_empty(self._made)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> ExpertStoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def _lock_folder(directory: Path) -> int | None:
    """An advisory lock on the folder for one writer; stale temporary files of a writer that
    died are removed once it is held."""
    if fcntl is None:  # pragma: no cover
        return None
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ExpertFileError(f"another process is writing an expert store in {directory}") from None
    for pattern in (".layer-*.lkx.*.tmp", f".{MANIFEST}.*.tmp"):
        for stale in directory.glob(pattern):
            fs.remove(stale)
    return fd


class LayerWriter:
    """One layer file, written expert by expert in order 0..E-1 under a temporary name and
    fsynced on close; the store's writer puts it in place."""

    def __init__(
        self,
        parent: ExpertStoreWriter,
        layer: int,
        n_experts: int,
        layout: ExtentLayout,
        ids: tuple[int, ...] | None = None,
    ):
        layout.validate()
        if ids is not None and (
            list(ids) != sorted(set(ids)) or (ids and not 0 <= ids[0] <= ids[-1] < n_experts)
        ):
            raise ValueError(
                f"layer {layer}: a share's expert ids must be distinct, ascending and below {n_experts}"
            )
        self.parent, self.layer, self.layout = parent, layer, layout
        self.total, self.ids = n_experts, None if ids is None else tuple(ids)
        self.order = tuple(range(n_experts)) if ids is None else self.ids  # the experts, in file order
        self.file = layer_file_name(layer)
        self.path = parent.directory / self.file
        self.checks: list[str] = []
        self._out: fs.Publish | None = fs.Publish(self.path, parent.DOING).__enter__()
        major, minor = (FORMAT_MAJOR, FORMAT_MINOR) if ids is None else (SHARE_MAJOR, 0)
        head = LAYER_HEADER.pack(MAGIC, major, minor, layer, len(self.order), parent.seed)
        self._pwrite(head + bytes(ALIGN - len(head)), 0)

    def write(self, expert: int, tensors: list[bytes | bytearray | memoryview]) -> None:
        """Expert `expert`'s raw tensors, in the layout's order, as bytes."""
        slot = len(self.checks)
        if slot >= len(self.order) or expert != self.order[slot]:
            expected = self.order[slot] if slot < len(self.order) else "none"
            raise ValueError(
                f"layer {self.layer}: experts are written in order; expected {expected}, got {expert}"
            )
        if len(tensors) != len(self.layout.tensors):
            raise ValueError(
                f"layer {self.layer}: the layout has {len(self.layout.tensors)} tensors, got {len(tensors)}"
            )
        extent = bytearray(self.layout.stride)
        for spec, data in zip(self.layout.tensors, tensors, strict=True):
            view = memoryview(data).cast("B")
            if len(view) != spec.nbytes:
                raise ValueError(
                    f"{expert_name(self.layer, expert)}.{spec.name}: {len(view)} bytes, layout says {spec.nbytes}"
                )
            extent[spec.offset : spec.offset + spec.nbytes] = view
        payload = memoryview(extent)[: self.layout.length]
        self.checks.append(extent_check(self.parent.seed, self.layer, expert, payload, self.parent.checksum))
        self._pwrite(extent, ALIGN + slot * self.layout.stride)
        self.parent.bytes_written += len(extent)

    def _pwrite(self, data, offset: int) -> None:
        try:
            self._out.pwrite(data, offset)
        except BaseException:
            self._abort()
            raise

    def close(self) -> None:
        """fsync the finished layer file (ValueError if experts are missing) for the store's writer."""
        out = self._out
        if out is None:
            return
        self._out = None
        if len(self.checks) != len(self.order):
            out.abort()
            raise ValueError(f"layer {self.layer}: {len(self.checks)} of {len(self.order)} experts written")
        out.close()
        self.parent._pending.append(out)
        self.parent.layers[self.layer] = LayerEntry(
            self.layer,
            self.file,
            self.layout,
            tuple(self.checks),
            self.ids,
            None if self.ids is None else self.total,
        )

    def _abort(self) -> None:
        if self._out is not None:
            self._out.abort()
            self._out = None

    def __enter__(self) -> LayerWriter:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()


# --- verifying one extent (the reader in `experts.reader` preads, this judges) ------------------


def check_layer_header(head: bytes, entry: LayerEntry, seed: bytes, path: Path) -> None:
    """The first bytes of a layer file against its manifest entry; ExpertFileError if foreign."""
    if len(head) < LAYER_HEADER.size:
        raise ExpertFileError(f"{path} is too short to be a layer file (truncated?)")
    magic, major, _minor, layer, experts, file_seed = LAYER_HEADER.unpack_from(head)
    want = FORMAT_MAJOR if entry.ids is None else SHARE_MAJOR
    if magic != MAGIC or major != want:
        raise ExpertFileError(f"{path} is not a version {want} latentkv expert layer file")
    if layer != entry.layer or experts != len(entry.checks):
        raise ExpertFileError(
            f"{path} holds layer {layer} ({experts} experts), the manifest says {entry.layer}"
        )
    if file_seed != seed:
        raise ExpertFileError(f"{path} was written for another model (its fingerprint differs)")


def verify_extent(
    seed: bytes,
    entry: LayerEntry,
    expert: int,
    payload: bytes | memoryview,
    path: Path,
    checksum: str = DEFAULT_CHECKSUM,
) -> None:
    """Raise ExpertDamaged (naming the expert) unless `payload` is exactly what was written."""
    name = expert_name(entry.layer, expert)
    length = entry.layout.length
    if len(payload) < length:
        raise ExpertDamaged(
            f"{name}: {path} ends inside this expert ({len(payload)} of {length} bytes; truncated file): refusing it"
        )
    if extent_check(seed, entry.layer, expert, memoryview(payload)[:length], checksum) != entry.check(expert):
        raise ExpertDamaged(
            f"{name}: fails its checksum in {path} at offset {entry.offset(expert)}: refusing it"
        )


# --- OS helpers --------------------------------------------------------------------------------


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover
        raise ExpertFileError("expert stores are little-endian and this host is not")
