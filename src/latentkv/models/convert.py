"""`latentkv convert`: a checkpoint rewritten in our quantized layout, loaded without re-quantizing.

OUT/ holds config.json (the source's, less its fp8 quantization_config), the tokenizer and other
small files copied as they are, `model.safetensors`, and the manifest `latentkv-weights.json`:

    {"format": "latentkv-weights", "version": 1,
     "weight_dtype": "int4", "expert_dtype": "int4", "group_size": 64,
     "source_fingerprint": sha256 of the source's safetensors headers,
     "model": {"model_type", "hidden_size", "num_hidden_layers", "n_routed_experts", ...},
     "tensors": {NAME: {"format": "int4", "shape": [out, in]}},      # the pre-quantized matrices
     "experts": {"LAYER": [[start, end], ...]}}      # each expert's byte extent in model.safetensors

A matrix stored in a packed format is its portable pieces, `NAME.<format>.<piece>` (int8: q,
scale; int4: nibbles, scale, zero; see weights/int8.py, int4.py), every piece with the output
rows first, so the loader fuses matrices by rows (q_a | kv_a | indexer.wk, gate | up) by
concatenating pieces. Matrices the loader transforms (q_b and the indexer's wq_b are scaled,
kv_b is split per head and transposed), the embedding, the router and the norms stay in the
source's float dtype (fp8 ones as bfloat16) and are quantized at load as from the original, so
the converted model is the model the original loads to; those matrices are small beside the
experts. Each routed expert's tensors (gate, up, down, with their scales) are written
back to back, one contiguous extent recorded in the manifest: the expert-streaming layout can
read one expert with one read (issue 16 aligns and checksums the extents).

From a GGUF (its view folder: models/gguf_view.py) the quantized matrices are written in the
formats they map onto, exactly where one holds them (weights/gguf_blocks.py), each manifest entry
saying its GGUF type and whether it is exact; MLA's per-head attn_k_b / attn_v_b are written as
`self_attn.k_b_proj.weight` / `v_b_proj.weight` when quantized (kept per head, exact) and
folded back into `kv_b_proj.weight` when float. Float tensors (F32, F16, BF16) are converted as
a safetensors checkpoint's are, in --weight-dtype.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from latentkv import fs
from latentkv.config import ModelConfig, read_json_object
from latentkv.models.loader import GGUF_POINTER, Checkpoint, CheckpointError, dequantize_fp8_blocks
from latentkv.weights.base import DenseLinear, dense_dtype, format_class

MANIFEST = "latentkv-weights.json"
FORMAT, VERSION = "latentkv-weights", 1
DTYPE_NAMES = {
    torch.float32: "F32",
    torch.int16: "I16",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    torch.int8: "I8",
}


class ConvertError(ValueError):
    """A conversion that cannot be done, said in one line."""


def packed_matrices(cfg: ModelConfig) -> Iterator[tuple[str, str]]:
    """(name, role) of every matrix the loader can take pre-quantized: role "dense" or "expert".
    The others are scaled, split or transposed at load (or are the router / embedding)."""
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if cfg.q_lora_rank:  # without q-LoRA, q_proj gets the softmax scale folded in at load
            yield a + "q_a_proj.weight", "dense"
            yield a + "kv_a_proj_with_mqa.weight", "dense"
            if cfg.dsa is not None and cfg.dsa.indexer_types[i] == "full":
                yield a + "indexer.wk.weight", "dense"
        yield a + "o_proj.weight", "dense"
        m = p + "mlp."
        if cfg.mlp_layer_types[i] == "sparse":
            for e in range(cfg.n_routed_experts):
                for part in ("gate_proj", "up_proj", "down_proj"):
                    yield f"{m}experts.{e}.{part}.weight", "expert"
            m += "shared_experts."
            if not cfg.n_shared_experts:
                continue
        for part in ("gate_proj", "up_proj", "down_proj"):
            yield f"{m}{part}.weight", "dense"
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", "dense"


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a converted checkpoint; None for any other checkpoint."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; this "
            f"latentkv reads {FORMAT} version {VERSION}: convert the model again"
        )
    return manifest


def convert(
    source: Path, out: Path, weight_dtype: str, expert_dtype: str | None = None, progress: bool = True
) -> dict:
    """Write `source` into `out` in our layout; returns the manifest.

    Everything is written into a temporary folder beside `out`, renamed onto it last (an empty
    folder at `out` is replaced): a failure (a full disk, a read-only one, an interruption)
    leaves `out` as it was and removes every byte written. The free space is checked first."""
    expert_dtype = expert_dtype or weight_dtype
    cfg = ModelConfig.from_hf(source)
    raw_cfg = read_json_object(source / "config.json")
    ckpt = Checkpoint(source)
    source_manifest = read_manifest(source)
    gguf_packed = (
        source_manifest["tensors"] if source_manifest and source_manifest.get("source") == "gguf" else {}
    )
    fmt_of = {"dense": weight_dtype, "expert": expert_dtype}
    need = 2 * output_bytes(ckpt, dict(packed_matrices(cfg)), fmt_of)  # the data file, then the model file
    doing = f"converting the model ({fs.gb(need // 2)}, {fs.gb(need)} while it is assembled)"
    fs.check_space(out.parent, need, doing)
    if progress:
        print(f"latentkv: writing {fs.gb(need // 2)} to {out}", file=sys.stderr)
    with fs.PublishDir(out, doing) as tmp:
        manifest = _write(source, tmp, cfg, raw_cfg, ckpt, fmt_of, gguf_packed, progress)
        try:
            (tmp / "config.json").write_text(
                json.dumps({k: v for k, v in raw_cfg.items() if k != "quantization_config"}, indent=1)
            )
            _copy_small_files(source, tmp)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        except OSError as exc:
            raise fs.naming(fs.error(exc, tmp, doing), tmp, out) from None
    return manifest


def output_bytes(ckpt: Checkpoint, roles: dict[str, str], fmt_of: dict[str, str]) -> int:
    """An estimate of model.safetensors' bytes: each tensor in the format it is written in."""
    total = 0
    for name in ckpt.keys():  # noqa: SIM118 (no __iter__)
        if name.endswith("weight_scale_inv"):
            continue
        n = math.prod(ckpt.shape(name))
        fmt = fmt_of[roles[name]] if name in roles else None
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # fused: split per expert
            first = name.rsplit("experts.", 1)[0] + "experts.0.gate_proj.weight"
            fmt = fmt_of[roles[first]] if first in roles else None
        if fmt is not None and not issubclass(format_class(fmt), DenseLinear):
            total += int(n * _bytes_per_weight(fmt))
        else:  # kept as floats (`_stored`)
            total += n * (
                2
                if _kept_bf16(fmt) or ckpt.dtype(name) not in ("F32", "BF16")
                else FLOAT_BYTES[ckpt.dtype(name)]
            )
    return total


FLOAT_BYTES = {"F32": 4, "BF16": 2}


@functools.cache
def _bytes_per_weight(fmt: str) -> float:
    """Bytes a packed format writes per weight (its pieces, scales included)."""
    rows, cols = 256, 1024
    pieces = format_class(fmt).quantize_state(torch.zeros(rows, cols))
    return sum(p.numel() * p.element_size() for p in pieces.values()) / (rows * cols)


def _write(
    source: Path,
    out: Path,
    cfg: ModelConfig,
    raw_cfg: dict,
    ckpt: Checkpoint,
    fmt_of: dict,
    gguf_packed: dict,
    progress: bool,
) -> dict:
    """model.safetensors into `out`; returns the manifest."""
    block = (raw_cfg.get("quantization_config") or {}).get("weight_block_size")
    roles = dict(packed_matrices(cfg))
    weight_dtype, expert_dtype = fmt_of["dense"], fmt_of["expert"]
    writer = _Writer(out / "model.safetensors")
    manifest_tensors: dict[str, dict] = {}
    experts: dict[str, list[list[int]]] = {}
    skip = ("weight_scale_inv", "experts.down_proj")  # read with their weight / gate_up
    names = _ordered([n for n in ckpt.keys() if not n.endswith(skip)])  # noqa: SIM118 (no __iter__)
    iterator = names
    if progress:
        from tqdm import tqdm

        iterator = tqdm(names, desc="converting", unit="tensor", file=sys.stderr)
    block_size = tuple(block) if block else None
    for source_name in iterator:
        if (start := _copy_packed(ckpt, gguf_packed, source_name, writer, manifest_tensors)) is not None:
            if roles.get(source_name) == "expert":
                _record_expert(experts, source_name, start, writer.size)
            continue
        for name, t in _tensors(ckpt, source_name, block_size):
            start = writer.size
            fmt = fmt_of[roles[name]] if name in roles else None
            if fmt is not None and not issubclass(format_class(fmt), DenseLinear):
                for piece, value in format_class(fmt).quantize_state(t).items():
                    writer.add(f"{name}.{fmt}.{piece}", value)
                manifest_tensors[name] = {"format": fmt, "shape": list(t.shape)}
            else:
                writer.add(name, _stored(t, fmt, weight_dtype))
            if roles.get(name) == "expert":
                _record_expert(experts, name, start, writer.size)
    data_start = writer.close()
    experts = {layer: [[a + data_start, b + data_start] for a, b in ext] for layer, ext in experts.items()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "weight_dtype": weight_dtype,
        "expert_dtype": expert_dtype,
        "source_fingerprint": ckpt.fingerprint(),
        "model": {
            k: raw_cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "n_routed_experts")
        },
        "tensors": manifest_tensors,
        "experts": experts,
    }


def _copy_packed(
    ckpt: Checkpoint, packed: dict, name: str, writer: _Writer, manifest_tensors: dict
) -> int | None:
    """Write a GGUF's pre-quantized matrix `name` as its state (kv_b_proj: the per-head k_b and
    v_b matrices, when those are stored quantized); its start offset when written, else None."""
    names = [name]
    if name.endswith("kv_b_proj.weight"):
        names = [name.replace("kv_b_proj", "k_b_proj"), name.replace("kv_b_proj", "v_b_proj")]
    if not all(n in packed for n in names):
        return None
    start = writer.size
    for n in names:
        fmt = packed[n]["format"]
        for piece in format_class(fmt).pieces:
            writer.add(f"{n}.{fmt}.{piece}", ckpt.get(f"{n}.{fmt}.{piece}"))
        manifest_tensors[n] = dict(packed[n])
        if ckpt.gguf is not None and n in ckpt.gguf.report:  # re-quantized: the error it was made with
            manifest_tensors[n].update(
                {k: ckpt.gguf.report[n][k] for k in ("rel_rms_error", "max_abs_error")}
            )
    return start


def _ordered(names: list[str]) -> list[str]:
    """Checkpoint order, except that each expert's tensors come together (gate, up, down)."""

    def key(name: str):
        where = _expert_of(name)
        return (name, -1) if where is None else (where[0], where[1], name)

    return sorted(names, key=key)


def _expert_of(name: str) -> tuple[str, int] | None:
    """("model.layers.3.mlp", 17) for "model.layers.3.mlp.experts.17.up_proj.weight"."""
    head, sep, rest = name.partition(".experts.")
    e = rest.split(".", 1)[0]
    return (head, int(e)) if sep and e.isdigit() else None


def _tensors(
    ckpt: Checkpoint, name: str, block: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The float tensor(s) a checkpoint name stands for: transformers' fused expert layout
    (`experts.gate_up_proj` [E, 2I, D] with `experts.down_proj` [E, D, I]) becomes each expert's
    own gate, up and down, expert after expert."""
    if not name.endswith("experts.gate_up_proj"):
        yield name, _float(ckpt, name, block)
        return
    head = name.removesuffix("gate_up_proj")
    gate_up, down = ckpt.get(name), ckpt.get(head + "down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        yield f"{head}{e}.gate_proj.weight", gate_up[e, :inter]
        yield f"{head}{e}.up_proj.weight", gate_up[e, inter:]
        yield f"{head}{e}.down_proj.weight", down[e]


def _float(ckpt: Checkpoint, name: str, block: tuple[int, int] | None) -> torch.Tensor:
    t = ckpt.get(name)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale_name = name.removesuffix("weight") + "weight_scale_inv"
        if block is None or scale_name not in ckpt:
            raise CheckpointError(f"{name} is fp8 but its weight_scale_inv or weight_block_size is missing")
        return dequantize_fp8_blocks(t, ckpt.get(scale_name), block)
    return t


def _kept_bf16(fmt: str | None) -> bool:
    """Whether a matrix of format `fmt` (None: not a matrix) is stored as bfloat16 floats."""
    return fmt is not None and dense_dtype(fmt) == torch.bfloat16


def _stored(t: torch.Tensor, fmt: str | None, weight_dtype: str) -> torch.Tensor:
    """A tensor kept as floats: in its checkpoint dtype (float32 or bfloat16; float16 as float32;
    an fp8 tensor, now dequantized, as bfloat16), so the loader makes of it exactly what it makes
    of the original; bf16 when that is the chosen format."""
    if _kept_bf16(fmt) or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return t.to(torch.bfloat16)
    return t.float() if t.dtype == torch.float16 else t  # a GGUF's F16: float32 holds it exactly


def _record_expert(experts: dict, name: str, start: int, end: int) -> None:
    where = _expert_of(name)
    if where is None:
        return
    head, e = where
    extents = experts.setdefault(head, [])
    if len(extents) == e:
        extents.append([start, end])
    else:
        extents[e][1] = end


class _Writer:
    """A safetensors file written in the order tensors are added (safetensors' own writer sorts
    them), data first to a side file, then the header and the data. Inside `convert`'s
    temporary folder: a failure anywhere leaves neither file."""

    DOING = "converting the model"

    def __init__(self, path: Path):
        self.path = path
        self._data_path = path.with_suffix(".data.tmp")
        self._data = fs.Publish(self._data_path, self.DOING).__enter__()
        self._entries: dict[str, dict] = {}
        self.size = 0  # bytes of data so far: offsets are relative to the data section

    def add(self, name: str, t: torch.Tensor) -> None:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self._entries[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self.size, self.size + len(raw)],
        }
        try:
            self._data.write(raw)
        except fs.DiskError as exc:  # the data file is ours: name the file being made
            raise fs.naming(exc, self._data_path, self.path) from None
        self.size += len(raw)

    def close(self) -> int:
        """Write the file; returns where the data section starts (offsets are relative to it)."""
        self._data.commit()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}).encode()
        header += b" " * (-len(header) % 8)
        with fs.Publish(self.path, self.DOING) as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            while chunk := data.read(16 << 20):
                out.write(chunk)
        fs.remove(self._data_path)
        return 8 + len(header)


def _copy_small_files(source: Path, out: Path) -> None:
    """Tokenizer, generation config, held-out text...: everything but weights and config."""
    skip = ("config.json", MANIFEST, "model.safetensors.index.json", GGUF_POINTER)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, out / f.name)
