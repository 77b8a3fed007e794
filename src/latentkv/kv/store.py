"""Conversations on disk: the versioned, crash-safe KV file (spec: docs/kv-file-format.md).

One file per conversation. A header fingerprints the model (architecture, the dims that shape a
record, a hash of the weights' safetensors headers) and the codec (tier, every parameter that
changes the bytes, each part's exact sizes); then one fixed-size record per token, appended in
batches ("turns") and each durable before its commit:

    record = token u32 | scales f32 (per layer: c, r) | DSA indexer keys f32 (per index layer)
             | codes u8 (per layer: c, r) | 16-byte chained SHA-256 check
    file size = D + tokens * R     (D: header + two commit slots, a 4 KiB multiple)

The bytes of each field are exactly what the cache stores (`state()`): for f32 the codes are
the float32 row [c | r]; for packed tiers the codec's codes and float32 scales.

    header = header_for(model.cfg, cache, checkpoint.fingerprint())
    with KVFile.create(path, header) as f:       # or KVFile.open(path, writable=True)
        f.append(tokens, cache, 0, len(tokens))   # durable when it returns
    result = KVFile.open(path).load(expected=header)   # KVMismatch when it does not load here
    cache = result.to_cache(tier)                      # ready, in the model's KVTier

`Session` (store_session.py) is the loop the CLI and server run on top of this: resume or start
over, save after every turn, move refused files aside.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from latentkv import fs
from latentkv.config import CacheConfig, ModelConfig
from latentkv.kv.cache import SHAPES_ONLY, CacheLayout, KVTier, SequenceCache, resolve_tier
from latentkv.kv.codecs import Codec
from latentkv.kv.store_compat import (
    REENCODE,
    SAME,
    Verdict,
    cache_config_for,
    compare,
    compare_codec,
    describe,
    is_f32,
    resume_flags,
)
from latentkv.kv.store_file import BLOCK, FORMAT_MAJOR, RecordFile, header_area, move_aside
from latentkv.kv.store_header import (
    CODEC_REVISION,
    CodecSpec,
    KVFileBusy,
    KVFileError,
    KVHeader,
    ModelFingerprint,
    PartFormat,
    RecordLayout,
)

Cache = SequenceCache


class KVMismatch(KVFileError):
    """The file is sound but does not load here (another model or codec); `verdict` says why."""

    def __init__(self, verdict: Verdict, path: Path | None = None):
        super().__init__(f"{path}: {verdict.message}" if path else verdict.message)
        self.verdict = verdict


# --- headers ---------------------------------------------------------------------------------


def header_for(cfg: ModelConfig, cache: Cache, checkpoint: str) -> KVHeader:
    """The header of a file holding `cache`'s rows for the model `cfg` (weights hash `checkpoint`)."""
    layout = CacheLayout.for_model(cfg, SHAPES_ONLY)
    if cache.layout != layout:
        raise ValueError(f"the cache's layout {cache.layout} is not the model's {layout}")
    model = ModelFingerprint(
        model_type=cfg.model_type,
        num_layers=cfg.num_layers,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        index_layers=layout.index_layers,
        index_head_dim=layout.index_head_dim,
        vocab_size=cfg.vocab_size,
        checkpoint=checkpoint,
    )
    return KVHeader(model, codec_spec_of(cache), tuple(range(cfg.num_layers)))


def codec_spec_of(cache: Cache) -> CodecSpec:
    """What `cache` writes: its tier, codec params and sizes for c and r."""
    return _spec(cache.tier)


def codec_spec(layout: CacheLayout, cfg: CacheConfig) -> CodecSpec:
    """What a cache of tier `cfg` for `layout` writes (f32: the row [c | r] as two f32 parts)."""
    return _spec(resolve_tier(layout, cfg))


def _spec(tier: KVTier) -> CodecSpec:
    c, r = tier.codec_c, tier.codec_r
    return CodecSpec(tier.name, _part(c, c.params()), _part(r, r.params()))


def _part(codec: Codec, params: dict[str, Any]) -> PartFormat:
    return PartFormat(dict(params), codec.code_bytes, codec.scale_count)


def header_problem(header: KVHeader) -> str | None:
    """Why a header that verifies still describes a file no latentkv writes, or None: its layers
    are not the model's, or its codec (params, widths, sizes) is not what its tier gives for the
    model's widths (a "tq4" whose params name f32; a width that is not kv_lora_rank). A codec of
    another revision is left to `compare`, which refuses it by name."""
    m = header.model
    if header.layers != tuple(range(m.num_layers)):
        return f"header field layers: {list(header.layers)[:8]} is not every one of the {m.num_layers} layers"
    spec = header.codec
    for part in ("c", "r"):
        params = getattr(spec, part).params
        seed, group = params.get("rotation_seed"), params.get("group_size")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64
        ):
            return f"header field codec.{part}.params.rotation_seed: {seed!r:.40} is not a 64-bit seed"
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
            return f"header field codec.{part}.params.group_size: {group!r:.40} is not a positive integer"
    try:  # the tier, with its knobs, must fit the model's widths (whatever the revision)
        expected = codec_spec(layout_of(header, SHAPES_ONLY), _own_config(spec))
    except (KVFileError, ValueError, TypeError, OverflowError) as exc:
        return f"header field codec: tier {spec.tier!r:.40} cannot be built for this model: {exc}"
    if spec.revision != CODEC_REVISION:  # other byte formats: `compare` refuses them by name
        return None
    for part in ("c", "r"):
        got, want = getattr(spec, part), getattr(expected, part)
        if got != want:
            return (
                f"header field codec.{part}: {_shown(got)} is not what tier {spec.tier} writes for "
                f"this model ({_shown(want)})"
            )
    return None


def _shown(part) -> str:
    return (
        f"params {dict(sorted(part.params.items()))}, {part.code_bytes} code bytes, {part.scale_count} scales"
    )


def layout_of(header: KVHeader, device: torch.device) -> CacheLayout:
    """The cache layout a file's records fill, its rows on `device` (a file must hold every layer
    to make a cache)."""
    m = header.model
    if header.layers != tuple(range(m.num_layers)):
        raise KVFileError(
            f"the file holds layers {list(header.layers)} only; a cache needs all {m.num_layers}"
        )
    return CacheLayout(
        m.num_layers,
        m.kv_lora_rank + m.qk_rope_head_dim,
        m.kv_lora_rank,
        m.index_layers,
        m.index_head_dim,
        device,
    )


# --- loading ---------------------------------------------------------------------------------


@dataclass
class LoadResult:
    header: KVHeader  # the file's
    tokens: list[int]  # one per record, the verified committed prefix
    state: dict[str, torch.Tensor]  # in the file's tier, as LatentCache / PackedLatentCache.state()
    verdict: Verdict | None = None  # compare(file, expected) when `load` got an expected header
    notes: list[str] = field(default_factory=list)  # what loading found: damage cut back, ...

    def own_tier(self, device: torch.device) -> KVTier:
        """The file's own tier, for rows on `device` (what a cache loads into without a model)."""
        return resolve_tier(layout_of(self.header, device), _own_config(self.header.codec))

    def to_cache(self, tier: KVTier) -> Cache:
        """A cache holding the loaded tokens in `tier` (a model's, or the file's `own_tier`), its
        rows on the tier's device.

        The same codec loads as stored; an f32 file under another tier is re-encoded from its
        exact rows; anything else raises KVMismatch.
        """
        layout = layout_of(self.header, tier.layout.device)
        if tier.layout != layout:
            raise KVFileError(f"the file's rows ({layout}) are not this tier's ({tier.layout})")
        verdict = compare_codec(self.header.codec, _spec(tier))
        if verdict.action == SAME:
            return tier.from_state(self.state)
        if verdict.action == REENCODE:
            return _reencode(tier, self.state, len(self.tokens))
        raise KVMismatch(verdict)


def _own_config(spec: CodecSpec) -> CacheConfig:
    try:
        return cache_config_for(spec)
    except ValueError as exc:  # a tier or knob this latentkv does not have
        raise KVFileError(f"the file's codec ({describe(spec)}) cannot be loaded here: {exc}") from None


def _reencode(tier: KVTier, state: dict[str, torch.Tensor], n: int) -> Cache:
    """f32 rows -> a cache of `tier`, through the cache's own append (the bytes it would store)."""
    layout = tier.layout
    cache = tier.make_cache()
    if n:
        for layer in range(layout.num_layers):
            cache.append(layer, state[f"rows.{layer}"])
        for layer in layout.index_layers:
            cache.append_index_keys(layer, state[f"index.{layer}"])
        cache.commit(n)
    return cache


@dataclass
class VerifyReport:
    ok: bool  # every committed record verifies
    committed: int  # records in the newest valid commit
    verified: int  # leading committed records that verify
    file_bytes: int
    expected_bytes: int  # D + committed * R
    notes: list[str]


class KVFile:
    """A KV file, cache-facing: append a cache's rows, load them back, verify."""

    def __init__(self, raw: RecordFile):
        self.raw = raw

    @classmethod
    def create(cls, path: str | Path, header: KVHeader, *, replace: bool = False) -> KVFile:
        """A new empty file (atomically); FileExistsError unless `replace`. Open for appending."""
        return cls(RecordFile.create(path, header, replace=replace))

    @classmethod
    def open(cls, path: str | Path, *, writable: bool = False) -> KVFile:
        """Open an existing file; KVFileError if its header is unreadable or impossible (see
        `header_problem`: fields that checksum but that no latentkv writes)."""
        raw = RecordFile.open(path, writable=writable)
        if (problem := header_problem(raw.header)) is not None:
            raw.close()
            raise KVFileError(problem)
        return cls(raw)

    @property
    def path(self) -> Path:
        return self.raw.path

    @property
    def header(self) -> KVHeader:
        return self.raw.header

    @property
    def committed(self) -> int:
        """Records in the newest commit (a writer: after `recover`, every one verified)."""
        return self.raw.committed

    def recover(self) -> int:
        """(Writers) cut a torn or damaged tail back to the verified prefix; its record count."""
        return self.raw.recover()

    def append(self, tokens: list[int], cache: Cache, start: int, end: int) -> int:
        """Append the rows of positions [start, end) of `cache` (ids `tokens`) as one durable turn.

        `start` must be the file's record count. Returns the new count.
        """
        count = self.raw.recover()
        if codec_spec_of(cache) != self.header.codec or cache.layout != layout_of(self.header, SHAPES_ONLY):
            raise ValueError(
                f"the cache ({describe(codec_spec_of(cache))}) does not match the file ({describe(self.header.codec)})"
            )
        if start != count or not start <= end <= cache.length or len(tokens) != end - start:
            raise ValueError(
                f"append needs start == {count} (the file's records) <= end <= {cache.length} (the cache's) "
                f"and one token per row; got start {start}, end {end}, {len(tokens)} tokens"
            )
        if end == start:
            return count
        payload = pack_records(self.raw.layout, tokens, cache, start, end)
        return self.raw.append(memoryview(payload).cast("B"), end - start)

    def truncate(self, n: int) -> None:
        """Keep the first n records (durably): a prompt that diverges keeps the common prefix."""
        self.raw.truncate(n)

    def load(self, expected: KVHeader | None = None) -> LoadResult:
        """The verified committed records; KVMismatch first if the file does not load under `expected`.

        A writable file is also cut back to what loaded.
        """
        verdict = compare(self.header, expected) if expected is not None else None
        if verdict is not None and not verdict.loads:
            raise KVMismatch(verdict, self.path)
        scan = self.raw.read()
        tokens, state = unpack_records(self.header, scan.data or bytearray(), scan.count)
        notes = list(scan.notes) + ([verdict.message] if verdict and verdict.action == REENCODE else [])
        return LoadResult(self.header, tokens, state, verdict, notes)

    def verify(self) -> VerifyReport:
        scan = self.raw.verify()
        return VerifyReport(
            ok=scan.count == scan.committed,
            committed=scan.committed,
            verified=scan.count,
            file_bytes=scan.file_bytes,
            expected_bytes=self.raw.size_for(scan.committed),
            notes=scan.notes,
        )

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> KVFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite(path: str | Path, header: KVHeader, tokens: list[int], cache: Cache) -> KVFile:
    """Replace `path` atomically by a file of `header` holding `cache`'s rows for `tokens`.

    Written beside it under a temporary name, then renamed over it: a crash, a full disk or any
    other failure leaves the old file (and no temporary one); errors name `path`.
    """
    path = Path(path)
    tmp = fs.temp_name(path, "rewrite")
    try:
        area, _ = header_area(header)
        size = len(area) + 2 * BLOCK + len(tokens) * header.record_layout().size
        fs.check_space(path.parent, size, f"rewriting the KV file {path.name}")
        f = KVFile.create(tmp, header)
    except fs.DiskError as exc:
        raise fs.naming(exc, tmp, path) from None
    try:
        f.append(tokens, cache, 0, len(tokens))
        f.raw.rename(path)
    except fs.DiskError as exc:
        f.close()
        fs.remove(tmp)
        raise fs.naming(exc, tmp, path) from None
    except BaseException:
        f.close()
        fs.remove(tmp)
        raise
    return f


# --- cache <-> record bytes ------------------------------------------------------------------


def pack_records(layout: RecordLayout, tokens: list[int], cache: Cache, start: int, end: int) -> np.ndarray:
    """The payloads of positions [start, end): uint8 [n, payload_size]."""
    n = end - start
    out = np.zeros((n, layout.payload_size), dtype=np.uint8)
    ids = np.asarray(tokens, dtype=np.int64).reshape(n)
    if n and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise ValueError(f"token ids must fit in u32, got {tokens[:5]}...")
    _put(out, layout, "token", ids.astype("<u4").view(np.uint8).reshape(n, 4))
    for name, tensor in _cache_fields(cache, start, end):
        _put(out, layout, name, tensor.contiguous().numpy().view(np.uint8).reshape(n, -1))
    return out


def _cache_fields(cache: Cache, start: int, end: int):
    """(record field name, rows [n, k]) for every stored part of positions [start, end)."""
    for layer in range(cache.layout.num_layers):
        yield from cache.stored_rows(layer, start, end)
    for layer in cache.layout.index_layers:
        yield f"index.{layer}", cache.index_keys(layer)[start:end]


def _put(out: np.ndarray, layout: RecordLayout, name: str, raw: np.ndarray) -> None:
    """Copy bytes [n, k] into the record field `name` (a part with no bytes has no field)."""
    if raw.shape[1] == 0:
        return
    f = layout.field(name)
    if raw.shape[1] != f.size:
        raise ValueError(f"{name}: {raw.shape[1]} bytes per row, the file's records hold {f.size}")
    out[:, f.offset : f.offset + f.size] = raw


def unpack_records(
    header: KVHeader, data: bytes | bytearray, n: int
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Verified record bytes -> (token ids, state in the file's tier)."""
    layout = header.record_layout()
    recs = np.frombuffer(data, dtype=np.uint8, count=n * layout.size).reshape(n, layout.size)

    def column(name: str, dtype: str | np.dtype, width: int) -> torch.Tensor:
        try:
            f = layout.field(name)
        except KeyError:  # a part with no bytes (f32 has no scales)
            return torch.from_numpy(np.zeros((n, 0), dtype=dtype))
        part = np.ascontiguousarray(recs[:, f.offset : f.offset + f.size])
        return torch.from_numpy(part.view(dtype).reshape(n, width))

    tokens = column("token", "<u4", 1)[:, 0].tolist()
    c, r = header.codec.c, header.codec.r
    state: dict[str, torch.Tensor] = {}
    for layer in header.layers:
        if is_f32(header.codec):
            parts = [
                column(f"{p}_codes.{layer}", "<f4", part.code_bytes // 4) for p, part in (("c", c), ("r", r))
            ]
            state[f"rows.{layer}"] = torch.cat(parts, dim=1)
            continue
        state[f"c_codes.{layer}"] = column(f"c_codes.{layer}", np.uint8, c.code_bytes)
        state[f"c_scales.{layer}"] = column(f"c_scales.{layer}", "<f4", c.scale_count)
        state[f"r_codes.{layer}"] = column(f"r_codes.{layer}", np.uint8, r.code_bytes)
        state[f"r_scales.{layer}"] = column(f"r_scales.{layer}", "<f4", r.scale_count)
    for layer in header.model.index_layers:
        state[f"index.{layer}"] = column(f"index.{layer}", "<f4", header.model.index_head_dim)
    return tokens, state


# --- inspection --------------------------------------------------------------------------------


def inspect(path: str | Path, current: KVHeader | None = None) -> dict[str, Any]:
    """What a KV file holds and whether it verifies (never raises on a bad file: see "error").

    With `current` (the header the running model and flags would write), "loads_here" holds
    the verdict of loading it.
    """
    path = Path(path)
    out: dict[str, Any] = {"path": str(path)}
    try:
        out["bytes"] = os.stat(path).st_size
        raw = RecordFile.open(path)
    except (KVFileError, OSError) as exc:
        return {**out, "verifies": False, "error": str(exc)}
    if (problem := header_problem(raw.header)) is not None:  # checksums fine, contents impossible
        raw.close()
        return {**out, "verifies": False, "error": f"not loadable: {problem}"}
    with raw:
        scan = raw.verify()
        h = raw.header
        out.update(
            format_version=f"{FORMAT_MAJOR}.{raw.minor}",
            file_id=h.file_id,
            created=h.created,
            writer=h.writer,
            model={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(h.model).items()},
            tier=h.codec.tier,
            codec={
                "description": describe(h.codec),
                "revision": h.codec.revision,
                "c": h.codec.c.params,
                "r": h.codec.r.params,
            },
            resume_flags=resume_flags(h.codec),
            layers=list(h.layers),
            tokens=scan.count,
            committed_tokens=scan.committed,
            record_bytes=raw.layout.size,
            header_bytes=raw.data_offset,
            expected_bytes=raw.size_for(scan.committed),
            verifies=scan.count == scan.committed,
            notes=scan.notes,
        )
        if current is not None:
            out["loads_here"] = compare(h, current).as_dict()
    return out


__all__ = [
    "KVFile",
    "KVFileBusy",
    "KVFileError",
    "KVHeader",
    "KVMismatch",
    "LoadResult",
    "Verdict",
    "VerifyReport",
    "codec_spec",
    "codec_spec_of",
    "compare",
    "header_for",
    "inspect",
    "layout_of",
    "move_aside",
    "rewrite",
]
