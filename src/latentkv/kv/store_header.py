"""The KV file's header: what a file holds, as data (stdlib only; see docs/kv-file-format.md).

    KVHeader
      model   ModelFingerprint  model_type, the dims that shape a record, vocab, checkpoint hash
      codec   CodecSpec         tier name + (params, code_bytes, scale_count) for c and for r
      layers  tuple[int]        the layers whose rows each record holds, in record order
      file_id, created, writer  identity and provenance (ignored when comparing headers)

`RecordLayout` turns a header into the byte layout of one record (fixed per file):

    token u32 | scales f32 (per layer: c, r) | index keys f32 (per index layer)
              | codes u8 (per layer: c, r)   | check 16 bytes

The header travels as canonical JSON. `KVHeader.from_json` treats its input as untrusted:
every field is type- and range-checked and a bad one raises KVFileError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from latentkv import fs

CHECK_BYTES = 16  # the truncated SHA-256 at the end of every record
TOKEN_BYTES = 4  # u32 token id at the start of every record
CODEC_REVISION = 1  # bump when any codec's byte format changes under unchanged params()

# Bounds on untrusted header values: generous for any real model, small enough that sizes
# computed from them cannot overflow or allocate absurd buffers.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20
MAX_VOCAB = 1 << 32
MAX_RECORD_BYTES = 1 << 30
MAX_JSON_DEPTH = 16  # the header nests 5 deep


class KVFileError(Exception):
    """A KV file that cannot be read or written as asked, with a message that says why."""


class KVFileBusy(KVFileError):
    """Another process holds the file open for writing: nothing is wrong with the file itself."""


class KVFileUnavailable(KVFileError):
    """The path is not a regular file we may open (a directory, FIFO, device; permission denied).
    Nothing was read from it, and it is not a damaged KV file: never move it aside."""


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything about the model that decides what a record means."""

    model_type: str
    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_layers: tuple[int, ...]  # layers that cache their own DSA indexer keys
    index_head_dim: int  # 0 without DSA
    vocab_size: int
    checkpoint: str  # SHA-256 hex over the safetensors headers (Checkpoint.fingerprint())


@dataclass(frozen=True)
class PartFormat:
    """How one part of a row (c or r) is stored: the codec's params and its exact sizes."""

    params: dict[str, Any]  # Codec.params(): name, width, bits, rotation_seed, group_size
    code_bytes: int
    scale_count: int  # float32 scales per row


@dataclass(frozen=True)
class CodecSpec:
    tier: str  # the --kv-cache-dtype name
    c: PartFormat
    r: PartFormat
    revision: int = CODEC_REVISION


@dataclass(frozen=True)
class KVHeader:
    model: ModelFingerprint
    codec: CodecSpec
    layers: tuple[int, ...]
    file_id: str = ""  # 32 hex digits, random, set by create
    created: str = ""  # UTC ISO-8601, set by create
    writer: str = ""  # "latentkv X.Y.Z", set by create
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys of a newer minor version

    def record_layout(self) -> RecordLayout:
        return record_layout(self)

    def to_json(self) -> bytes:
        m, c = self.model, self.codec
        obj = {
            **self.extra,
            "model": {
                "model_type": m.model_type,
                "num_layers": m.num_layers,
                "kv_lora_rank": m.kv_lora_rank,
                "qk_rope_head_dim": m.qk_rope_head_dim,
                "index_layers": list(m.index_layers),
                "index_head_dim": m.index_head_dim,
                "vocab_size": m.vocab_size,
                "checkpoint": m.checkpoint,
            },
            "codec": {"tier": c.tier, "revision": c.revision, "c": _part_json(c.c), "r": _part_json(c.r)},
            "layers": list(self.layers),
            "file_id": self.file_id,
            "created": self.created,
            "writer": self.writer,
        }
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_json(cls, data: bytes) -> KVHeader:
        try:  # nesting bounded before parsing; ValueError: not UTF-8, not JSON, huge ints
            obj = fs.load_json(bytes(data), MAX_JSON_DEPTH)
        except ValueError as exc:
            raise KVFileError(f"the header is not valid JSON ({exc})") from None
        _want(isinstance(obj, dict), "header", "a JSON object", obj)
        model = _model(_obj(obj, "model"))
        codec = _codec(_obj(obj, "codec"))
        layers = _layer_list(obj, "layers", model.num_layers, "layers")
        known = {"model", "codec", "layers", "file_id", "created", "writer"}
        header = cls(
            model=model,
            codec=codec,
            layers=layers,
            file_id=_str(obj, "file_id", "file_id", 64),
            created=_str(obj, "created", "created", 64),
            writer=_str(obj, "writer", "writer", 200),
            extra={k: v for k, v in obj.items() if k not in known},
        )
        if not header.layers:
            raise KVFileError("header field layers: a file must hold at least one layer")
        header.record_layout()  # bounds the record size
        return header


def _part_json(part: PartFormat) -> dict[str, Any]:
    return {"params": dict(part.params), "code_bytes": part.code_bytes, "scale_count": part.scale_count}


# --- the record layout ---------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One run of bytes inside a record."""

    name: str  # "token", "c_scales.3", "index.0", "c_codes.3", "check", ...
    offset: int
    size: int


@dataclass(frozen=True)
class RecordLayout:
    fields: tuple[Field, ...]
    size: int  # bytes per record, the check included
    scales: tuple[int, int]  # [start, stop) of the float32 scale block (checked on read and write)

    @property
    def payload_size(self) -> int:
        """Bytes a writer supplies per record: everything but the check."""
        return self.size - CHECK_BYTES

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)


def record_layout(header: KVHeader) -> RecordLayout:
    """The byte layout of one record under `header` (see the module docstring)."""
    c, r = header.codec.c, header.codec.r
    fields: list[Field] = []
    offset = 0

    def add(name: str, size: int) -> None:
        nonlocal offset
        if size:
            fields.append(Field(name, offset, size))
            offset += size

    add("token", TOKEN_BYTES)
    for layer in header.layers:
        add(f"c_scales.{layer}", 4 * c.scale_count)
        add(f"r_scales.{layer}", 4 * r.scale_count)
    scales = (TOKEN_BYTES, offset)
    for layer in header.model.index_layers:
        add(f"index.{layer}", 4 * header.model.index_head_dim)
    for layer in header.layers:
        add(f"c_codes.{layer}", c.code_bytes)
        add(f"r_codes.{layer}", r.code_bytes)
    add("check", CHECK_BYTES)
    if offset > MAX_RECORD_BYTES:
        raise KVFileError(f"records of {offset} bytes exceed the limit of {MAX_RECORD_BYTES}")
    return RecordLayout(tuple(fields), offset, scales)


# --- validation of untrusted JSON ----------------------------------------------------------


def _want(ok: bool, where: str, what: str, got: Any) -> None:
    if not ok:
        shown = repr(got)
        raise KVFileError(f"header field {where}: expected {what}, got {shown[:60]}")


def _obj(d: dict, key: str, where: str | None = None) -> dict:
    value = d.get(key)
    _want(isinstance(value, dict), where or key, "a JSON object", value)
    return value


def _int(d: dict, key: str, where: str, lo: int, hi: int) -> int:
    value = d.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    _want(ok, where, f"an integer in {lo}..{hi}", value)
    return value


def _str(d: dict, key: str, where: str, limit: int) -> str:
    value = d.get(key)
    _want(isinstance(value, str) and len(value) <= limit, where, f"a string of at most {limit} chars", value)
    return value


def _layer_list(d: dict, key: str, num_layers: int, where: str) -> tuple[int, ...]:
    value = d.get(key)
    ok = (
        isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < num_layers for v in value)
        and all(value[i] < value[i + 1] for i in range(len(value) - 1))
    )
    _want(ok, where, f"strictly increasing layer indices in 0..{num_layers - 1}", value)
    return tuple(value)


def _model(d: dict) -> ModelFingerprint:
    num_layers = _int(d, "num_layers", "model.num_layers", 1, MAX_LAYERS)
    index_layers = _layer_list(d, "index_layers", num_layers, "model.index_layers")
    index_head_dim = _int(d, "index_head_dim", "model.index_head_dim", 0, MAX_WIDTH)
    if index_layers and not index_head_dim:
        raise KVFileError("header field model.index_head_dim: index layers need a positive width")
    return ModelFingerprint(
        model_type=_str(d, "model_type", "model.model_type", 100),
        num_layers=num_layers,
        kv_lora_rank=_int(d, "kv_lora_rank", "model.kv_lora_rank", 1, MAX_WIDTH),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", "model.qk_rope_head_dim", 1, MAX_WIDTH),
        index_layers=index_layers,
        index_head_dim=index_head_dim,
        vocab_size=_int(d, "vocab_size", "model.vocab_size", 1, MAX_VOCAB),
        checkpoint=_str(d, "checkpoint", "model.checkpoint", 128),
    )


def _codec(d: dict) -> CodecSpec:
    return CodecSpec(
        tier=_str(d, "tier", "codec.tier", 40),
        c=_part(_obj(d, "c", "codec.c"), "codec.c"),
        r=_part(_obj(d, "r", "codec.r"), "codec.r"),
        revision=_int(d, "revision", "codec.revision", 0, 1 << 31),
    )


def _part(d: dict, where: str) -> PartFormat:
    params = _obj(d, "params", f"{where}.params")
    for key, value in params.items():
        scalar = value is None or isinstance(value, (str, int, float, bool))
        _want(scalar, f"{where}.params.{key}", "a JSON scalar", value)
    _want(isinstance(params.get("name"), str), f"{where}.params.name", "a codec name", params.get("name"))
    return PartFormat(
        params=params,
        code_bytes=_int(d, "code_bytes", f"{where}.code_bytes", 0, MAX_WIDTH * 4),
        scale_count=_int(d, "scale_count", f"{where}.scale_count", 0, MAX_WIDTH),
    )
