"""An expert <-> the raw tensors of its on-disk extent (the torch side of `store_file`).

An extent holds an expert's two Linear objects, gate_up [2I, D] and down [D, I], each as its
format's raw tensors: `weight` (f32, bf16), `q` + `scale` (int8), and for int4 `packed` +
`scale_zeros` in the packed layout of the writing process (`int4.layout()`: latentkv's kernel's,
or the CPU's int4 op's), which the params name (a process with that layout uses the bytes as
read, so a read expert needs no packing; another repacks them; bytes copied onto a CUDA device,
a VRAM expert slot, are rewritten there in place in the CUDA op's layout, so rebuilding an
expert over a slot is done once per copy), or the portable `nibbles` + `scale` + `zero` where
the writer's layout was not understood.
The layout's meta records each Linear's format and parameters, so the reader rebuilds exactly
the objects the converter wrote: plain and int8 tensors are views of the read buffer (no copy).

A format joins by registering how its raw tensors come and go (`register_codec`); f32, bf16,
int8 and int4 are registered here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from latentkv.experts.base import Expert
from latentkv.experts.reader import Extent
from latentkv.experts.store_file import ExtentLayout
from latentkv.weights import int4
from latentkv.weights.base import FORMATS, DenseLinear, Linear, format_class
from latentkv.weights.int4 import Int4Linear
from latentkv.weights.int8 import Int8Linear

PARTS = ("gate_up", "down")


@dataclass(frozen=True)
class LinearCodec:
    """How one weight format's Linear maps to raw tensors and back."""

    to_raw: Callable[[Linear], tuple[dict, dict[str, torch.Tensor]]]  # -> (params, tensors in order)
    from_raw: Callable[[str, dict, dict[str, torch.Tensor]], Linear]  # (format, params, tensors)


CODECS: dict[str, LinearCodec] = {}


def register_codec(fmt: str, codec: LinearCodec) -> None:
    CODECS[fmt] = codec


def codec_for(fmt: str) -> LinearCodec:
    try:
        return CODECS[fmt]
    except KeyError:
        raise ValueError(
            f"weight format {fmt!r} cannot be streamed from disk yet; streamable: {', '.join(sorted(CODECS))}"
        ) from None


def _dense_to_raw(lin: Linear) -> tuple[dict, dict[str, torch.Tensor]]:
    tensors = {"weight": lin.dense}
    if lin.bias is not None:
        tensors["bias"] = lin.bias
    return {}, tensors


def _dense_from_raw(fmt: str, params: dict, tensors: dict[str, torch.Tensor]) -> Linear:
    cls = format_class(fmt)
    return cls(tensors["weight"], tensors.get("bias"))


DENSE = LinearCodec(_dense_to_raw, _dense_from_raw)
for _cls in [c for c in FORMATS.values() if issubclass(c, DenseLinear)]:
    register_codec(_cls.format, DENSE)


def _with_bias(lin: Linear, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if lin.bias is not None:
        tensors["bias"] = lin.bias
    return tensors


def _int8_to_raw(lin: Linear) -> tuple[dict, dict[str, torch.Tensor]]:
    return {}, _with_bias(lin, {"q": lin.q, "scale": lin.scale})  # int8 [out, in], bfloat16 [out]


def _int8_from_raw(fmt: str, params: dict, tensors: dict[str, torch.Tensor]) -> Linear:
    return format_class(fmt)(tensors["q"], tensors["scale"], tensors.get("bias"), keep=True)


def _int4_to_raw(lin: Linear) -> tuple[dict, dict[str, torch.Tensor]]:
    # The Linear's packed layout, named in params so that a process with another layout repacks
    # it when read (and one with this layout uses the bytes as they are); where the layout is
    # not understood, or the scales are float32 (kept apart from scale_zeros), the portable
    # nibbles with those scales and zeros.
    layout = lin.layout
    if layout is None or lin._out_padded % layout[0] or lin.zero_t is not None:
        nibbles, scale, zero = lin.nibbles()
        return {"in_features": lin.in_features}, _with_bias(
            lin, {"nibbles": nibbles, "scale": scale, "zero": zero}
        )
    params = {"in_features": lin.in_features, "out_features": lin.out_features}
    params["layout"] = int4.layout_spec(layout)
    return params, _with_bias(lin, {"packed": lin.packed, "scale_zeros": lin.scale_zeros})


def _int4_from_raw(fmt: str, params: dict, tensors: dict[str, torch.Tensor]) -> Linear:
    t = tensors
    cls = format_class(fmt)
    if "packed" not in t:
        return cls(t["nibbles"], t["scale"], t["zero"], params["in_features"], t.get("bias"))
    out_f = params["out_features"]
    stored, native = _int4_layout(json.dumps(params["layout"], sort_keys=True))
    if t["packed"].is_cuda:  # copied to a GPU as the host holds it (a VRAM slot): converted there
        return cls.converted_on_cuda(
            t["packed"], stored, t["scale_zeros"], params["in_features"], out_f, t.get("bias")
        )
    if native and t["packed"].shape[0] == -(-out_f // int4.row_multiple()) * int4.row_multiple():
        return cls.from_packed(t["packed"], t["scale_zeros"], params["in_features"], out_f, t.get("bias"))
    # written by a process that packs differently (another CPU's op, or the other of op and kernel)
    nibbles, scale, zero = int4_portable(params, t)
    return cls(nibbles, scale, zero, params["in_features"], t.get("bias"))


@functools.lru_cache(maxsize=16)
def _int4_layout(spec: str) -> tuple[int4.Layout, bool]:
    """A stored layout (its JSON) and whether it is this process's: parsed once per store, not
    per read."""
    layout = int4.layout_from_spec(json.loads(spec))
    return layout, int4.same_layout(layout, int4.layout())


def int4_portable(
    params: dict, raw: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 Linear's raw tensors (either form) -> its portable (nibbles [out, in_padded / 2],
    scale, zero [out, groups]), with no packing for this CPU (what tools reading a store use)."""
    if "packed" not in raw:
        return raw["nibbles"], raw["scale"], raw["zero"]
    stored, _native = _int4_layout(json.dumps(params["layout"], sort_keys=True))
    return int4.portable(raw["packed"], raw["scale_zeros"], params["out_features"], stored)


register_codec(Int8Linear.format, LinearCodec(_int8_to_raw, _int8_from_raw))
register_codec(Int4Linear.format, LinearCodec(_int4_to_raw, _int4_from_raw))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def expert_layout(expert: Expert) -> tuple[ExtentLayout, list[torch.Tensor]]:
    """The extent layout of `expert` (the same for every expert of a layer) and its raw tensors
    in the layout's order."""
    specs, tensors, meta = [], [], {}
    for part in PARTS:
        lin: Linear = getattr(expert, part)
        params, raw = codec_for(lin.format).to_raw(lin)
        meta[part] = {
            "format": lin.format,
            "params": params,
            "in_features": lin.in_features,
            "out_features": lin.out_features,
            "tensors": list(raw),
        }
        for name, t in raw.items():
            specs.append((f"{part}.{name}", _dtype_name(t.dtype), tuple(t.shape)))
            tensors.append(t.contiguous())
    return ExtentLayout.pack(specs, meta), tensors


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (no copy for a contiguous tensor)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def expert_from_extent(extent: Extent) -> Expert:
    """Rebuild the expert an extent holds; its tensors are views of the extent's buffer."""
    return expert_from_views(
        extent.layout, lambda name: _view(extent, name), f"layer {extent.layer} expert {extent.expert}"
    )


def expert_from_views(
    layout: ExtentLayout, view: Callable[[str], torch.Tensor], what: str = "an expert"
) -> Expert:
    """Rebuild the expert `layout` describes over the tensors `view(name)` hands (an extent's
    buffer read from disk, or a flat buffer in memory: `flat_view`)."""
    parts = []
    for part in PARTS:
        m = layout.meta[part]
        tensors = {name: view(f"{part}.{name}") for name in m["tensors"]}
        lin = codec_for(m["format"]).from_raw(m["format"], m["params"], tensors)
        if (lin.in_features, lin.out_features) != (m["in_features"], m["out_features"]):
            raise ValueError(f"{what}: {part} rebuilt with the wrong shape")
        parts.append(lin)
    return Expert(*parts)


def flat_view(buffer: torch.Tensor, layout: ExtentLayout, name: str, base: int = 0) -> torch.Tensor:
    """Tensor `name` of `layout` inside a flat uint8 tensor `buffer` (on any device), the extent
    starting at byte `base`."""
    spec = layout.spec(name)
    start = base + spec.offset
    return buffer[start : start + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)


def _view(extent: Extent, name: str) -> torch.Tensor:
    spec = extent.layout.spec(name)
    dtype = getattr(torch, spec.dtype)
    count = 1
    for d in spec.shape:
        count *= d
    if count == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return torch.frombuffer(extent.buffer, dtype=dtype, count=count, offset=spec.offset).view(spec.shape)


__all__ = [
    "CODECS",
    "DenseLinear",
    "LinearCodec",
    "codec_for",
    "expert_from_extent",
    "expert_from_views",
    "expert_layout",
    "flat_view",
    "int4_portable",
    "register_codec",
]
