"""Does a KV file load here? Pure functions from (file header, current header) to a verdict.

    same      the file's model and codec are the current ones: load it as it is
    reencode  the file is f32 and the current tier is another one: encode its exact f32 rows in
              the current tier in memory, and rewrite the file in that tier at the next save
    refuse    a different model, layer set, codec, bit width, rotation seed, group size or codec
              revision: start over; the message names what differs and the flags that resume it

A quantized file is never "upgraded" to a wider tier: its rows lost precision when they were
written, and widening them would pass quantized rows off as full-precision ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from latentkv.config import DEFAULT_ROTATION_SEED, CacheConfig
from latentkv.kv.store_header import CodecSpec, KVHeader, ModelFingerprint

SAME, REENCODE, REFUSE = "same", "reencode", "refuse"


@dataclass(frozen=True)
class Verdict:
    action: str  # SAME, REENCODE or REFUSE
    message: str  # one line for the user
    differences: tuple[str, ...] = ()  # "what: file X, current Y", one per difference
    resume_flags: str = ""  # CLI flags that load the file as it is ("" for another model)

    @property
    def loads(self) -> bool:
        return self.action != REFUSE

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "message": self.message,
            "differences": list(self.differences),
            "resume_flags": self.resume_flags,
        }


def compare(file: KVHeader, current: KVHeader) -> Verdict:
    """The verdict on loading a file with header `file` where the model and tier give `current`."""
    diffs = model_differences(file.model, current.model)
    if file.layers != current.layers:
        diffs.append(f"layer set: file {list(file.layers)}, current {list(current.layers)}")
    if diffs:
        return Verdict(
            REFUSE,
            f"the KV file was saved with a different model ({'; '.join(diffs)}): "
            "resume it with the model it was saved with",
            tuple(diffs),
        )
    return compare_codec(file.codec, current.codec)


def compare_codec(file: CodecSpec, current: CodecSpec) -> Verdict:
    """The codec half of `compare` (what `kv inspect` can say without loading a model)."""
    if file == current:
        return Verdict(SAME, f"the KV file matches the current tier ({describe(file)})")
    flags = resume_flags(file, current)
    if file.revision != current.revision:
        diff = f"codec byte format revision: file {file.revision}, current {current.revision}"
        return Verdict(REFUSE, f"the KV file was written by a latentkv with another {diff}", (diff,), "")
    if is_f32(file):
        return Verdict(
            REENCODE,
            f"the KV file is f32: re-encoding it to {describe(current)} in memory "
            f"(rewritten as {current.tier} at the next save)",
            tuple(codec_differences(file, current)),
            flags,
        )
    wider = "a quantized file is never widened; " if _row_bytes(current) > _row_bytes(file) else ""
    flags = resume_flags(file, current)
    drop = _knob(file, "group_size") is None and _knob(current, "group_size") is not None
    how = f"{flags} (without --kv-group-size)" if drop else flags
    differences = tuple(codec_differences(file, current))
    # the current tier's knobs are shown when they are part of what differs
    shown = current.tier if differences == (f"tier: file {file.tier}, current {current.tier}",) else None
    return Verdict(
        REFUSE,
        f"file is {describe(file)}, current is {shown or describe(current)}: {wider}pass {how} to resume it",
        differences,
        flags,
    )


def model_differences(file: ModelFingerprint, current: ModelFingerprint) -> list[str]:
    out = []
    for f in fields(ModelFingerprint):
        a, b = getattr(file, f.name), getattr(current, f.name)
        if a != b:
            if f.name == "checkpoint":
                out.append(f"weights fingerprint: file {a[:12]}, current {b[:12]}")
            else:
                out.append(f"{f.name}: file {_show(a)}, current {_show(b)}")
    return out


def codec_differences(file: CodecSpec, current: CodecSpec) -> list[str]:
    """Every parameter that differs: the tier, and each knob (rotation seed, group size) that
    both tiers have (or that one tier has in two settings)."""
    out = []
    if file.tier != current.tier:
        out.append(f"tier: file {file.tier}, current {current.tier}")
    for key, label in KNOBS:
        a, b = _knob(file, key), _knob(current, key)
        both = _has_knob(file, key) and _has_knob(current, key)
        if a != b and (both or file.tier == current.tier):
            out.append(f"{label}: file {_param(key, a)}, current {_param(key, b)}")
    if not out:  # same tier and knobs, yet different: params or sizes from another codec version
        for part in ("c", "r"):
            a, b = getattr(file, part), getattr(current, part)
            if a != b:
                out.append(f"codec.{part}: file {_part(a)}, current {_part(b)}")
    return out


KNOBS = (("rotation_seed", "rotation seed"), ("group_size", "group size"))  # their flags: FLAGS
FLAGS = {"rotation_seed": "--kv-seed", "group_size": "--kv-group-size"}


def _has_knob(spec: CodecSpec, key: str) -> bool:
    return key in spec.c.params or key in spec.r.params


def _knob(spec: CodecSpec, key: str) -> Any:
    """A codec knob's value: the latent part's, else the rope part's (mixed tiers), else None."""
    for part in (spec.c, spec.r):
        if part.params.get(key) is not None:
            return part.params[key]
    return None


def describe(spec: CodecSpec) -> str:
    """'tq4 (rotation seed 0x9e3779b9)', 'tq4-r8 (rotation seed 0x9e3779b9, group size 32)',
    'fp8 (group size 32)', 'fp8 (one scale per row)', 'bf16'."""
    params = spec.c.params
    if "rotation_seed" in params:
        group = f", group size {params['group_size']}" if params.get("group_size") is not None else ""
        return f"{spec.tier} (rotation seed {_param('rotation_seed', params['rotation_seed'])}{group})"
    if "group_size" in params:
        group = params["group_size"]
        return f"{spec.tier} ({'one scale per row' if group is None else f'group size {group}'})"
    return spec.tier


def resume_flags(spec: CodecSpec, current: CodecSpec | None = None) -> str:
    """The CLI flags whose cache writes exactly this codec. The default rotation seed needs no
    flag, unless `current` (what the run's flags give) has another seed: then it is named."""
    flags = [f"--kv-cache-dtype {spec.tier}"]
    seed = _knob(spec, "rotation_seed")
    other_seed = current is not None and _knob(current, "rotation_seed") not in (None, seed)
    if seed is not None and (seed != DEFAULT_ROTATION_SEED or other_seed):
        flags.append(f"--kv-seed {_param('rotation_seed', seed)}")
    if (group := _knob(spec, "group_size")) is not None:
        flags.append(f"--kv-group-size {group}")
    return " ".join(flags)


def cache_config_for(spec: CodecSpec) -> CacheConfig:
    """The CacheConfig that resumes a file as it is (what `resume_flags` says, as config)."""
    seed = _knob(spec, "rotation_seed")
    return CacheConfig(
        kv_cache_dtype=spec.tier,
        rotation_seed=DEFAULT_ROTATION_SEED if seed is None else seed,
        group_size=_knob(spec, "group_size"),
    )


def is_f32(spec: CodecSpec) -> bool:
    return spec.c.params.get("name") == "f32" and spec.r.params.get("name") == "f32"


def _row_bytes(spec: CodecSpec) -> int:
    return spec.c.code_bytes + 4 * spec.c.scale_count + spec.r.code_bytes + 4 * spec.r.scale_count


def _param(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if key == "rotation_seed" and isinstance(value, int):
        return hex(value)
    return str(value)


def _part(part: Any) -> str:
    return f"{part.params} ({part.code_bytes} code bytes, {part.scale_count} scales)"


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)
