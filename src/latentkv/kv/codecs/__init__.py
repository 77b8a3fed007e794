"""KV row codecs, by name: f32, bf16, fp8, tq2..tq6, polar2..polar6, llama.cpp's block formats
q8_0, q5_0, q4_0, q4_1 and their rotated variants hq8_0 .. hq4_1; and the tiers built from them.

    codec = get_codec("tq4", width=512)        # one codec per row width (c and r separately)
    enc = codec.encode(rows)                   # EncodedRows(codes uint8 [N, B], scales f32 [N, S])
    codec.bytes_per_row                        # B + 4 S, exactly what a row costs
    TIERS["tq4-r8"]                            # ("tq4", "fp8"): the codecs of c and of r

Names follow vLLM's `--kv-cache-dtype`. The rotated codecs (tq*, polar*) need power-of-two
widths and refuse others with a ValueError that suggests fp8. `group_size` (one scale per
group of values instead of one per row) applies to fp8, tq* and polar*.
"""

from __future__ import annotations

from collections.abc import Callable

from latentkv.kv.codecs.base import Codec, EncodedRows
from latentkv.kv.codecs.blocks import FORMATS as BLOCK_FORMATS
from latentkv.kv.codecs.blocks import BlockCodec, RotatedBlockCodec, SearchedBlockCodec
from latentkv.kv.codecs.fp8 import Fp8Codec
from latentkv.kv.codecs.identity import Bf16Codec, F32Codec
from latentkv.kv.codecs.polar import PolarCodec
from latentkv.kv.codecs.rotation import DEFAULT_SEED
from latentkv.kv.codecs.tiers import TIER_NAMES, TIERS, TierCodecs
from latentkv.kv.codecs.turbo import TurboCodec

# name -> factory(width, seed, group_size)
_Factory = Callable[[int, int, int | None], Codec]


GROUPED_CODECS = ("fp8", *(f"tq{b}" for b in range(2, 7)), *(f"polar{b}" for b in range(2, 7)))


def _no_groups(name: str, group_size: int | None) -> None:
    if group_size is not None:
        raise ValueError(f"group size applies to fp8, tq* and polar* only, not to {name}")


def _identity(cls: type[F32Codec] | type[Bf16Codec]) -> _Factory:
    def make(width: int, seed: int, group_size: int | None) -> Codec:
        _no_groups(cls.name, group_size)
        return cls(width)

    return make


def _fp8(width: int, seed: int, group_size: int | None) -> Codec:
    return Fp8Codec(width, group_size=group_size)


def _rotated(cls: type[TurboCodec] | type[PolarCodec], prefix: str, bits: int) -> _Factory:
    def make(width: int, seed: int, group_size: int | None) -> Codec:
        return cls(width, bits, seed=seed, group_size=group_size)

    return make


def _block(fmt: str, rotate: bool) -> _Factory:
    def make(width: int, seed: int, group_size: int | None) -> Codec:
        _no_groups(("h" if rotate else "") + fmt, group_size)
        return (RotatedBlockCodec if rotate else BlockCodec)(width, fmt, seed=seed)

    return make


def _searched(name: str) -> _Factory:
    def make(width: int, seed: int, group_size: int | None) -> Codec:
        _no_groups(name, group_size)
        return SearchedBlockCodec(width, name)

    return make


CODECS: dict[str, _Factory] = {
    "f32": _identity(F32Codec),
    "bf16": _identity(Bf16Codec),
    "fp8": _fp8,
    **{f"tq{b}": _rotated(TurboCodec, "tq", b) for b in range(2, 7)},
    **{f"polar{b}": _rotated(PolarCodec, "polar", b) for b in range(2, 7)},
    **{fmt: _block(fmt, False) for fmt in BLOCK_FORMATS},
    **{f"h{fmt}": _block(fmt, True) for fmt in BLOCK_FORMATS},
    **{name: _searched(name) for name in ("q8s", "q5s", "q4s", "wq4")},
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)


def get_codec(name: str, width: int, *, seed: int = DEFAULT_SEED, group_size: int | None = None) -> Codec:
    """The codec `name` bound to rows of `width` values.

    `seed` is the rotation seed of the rotated codecs; `group_size` gives fp8, tq* and polar*
    one scale per `group_size` values (it must divide `width`) instead of one per row.
    """
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; valid names: {', '.join(CODEC_NAMES)}")
    return CODECS[name](width, seed, group_size)


__all__ = [
    "CODEC_NAMES",
    "GROUPED_CODECS",
    "TIERS",
    "TIER_NAMES",
    "TierCodecs",
    "Bf16Codec",
    "BlockCodec",
    "Codec",
    "EncodedRows",
    "F32Codec",
    "Fp8Codec",
    "PolarCodec",
    "RotatedBlockCodec",
    "SearchedBlockCodec",
    "TurboCodec",
    "get_codec",
]
