"""The GGUF twin of the expert-streaming benchmark model (issue 16): the same weights for llama.cpp.

    .venv/bin/python benchmarks/expert_twin.py ~/.cache/latentkv/experts-bench \\
        ~/.cache/latentkv/experts-bench-gguf            # build (about 30 GB of disk at the peak)
    .venv/bin/python benchmarks/expert_twin.py ~/.cache/latentkv/experts-bench \\
        ~/.cache/latentkv/experts-bench-gguf --verify   # the twin's experts vs the store's

The dense tensors are the checkpoint's (f32, kept f32). The routed experts are dequantized from
the expert store (OUT/experts/) one projection of one expert at a time, inside llama.cpp's own
converter (its lazy tensors: nothing is computed before the GGUF writer asks for a layer's
merged tensor), written as f16, then `llama-quantize` turns only the `*_exps` tensors into the
llama.cpp format nearest to ours and copies everything else:

    ours int4: group 64, asymmetric, bf16 scale + zero per group -> 4.5 bits per weight
    Q4_K:      super-blocks of 256, 8 asymmetric sub-blocks of 32 (6-bit scale + min) -> 4.5 bits

(Q4_0 is symmetric, Q4_1 costs 5 bits.) The f16 intermediate is deleted once quantized; the
twin's folder keeps `twin.gguf` and `twin.json` (formats, sizes, the peak disk use).
The converter needs a tokenizer: the fixture's (`src/latentkv/builtin/fixture`) is used, padded
to the model's vocabulary; llama-bench feeds random tokens anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "src" / "latentkv" / "builtin" / "fixture"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GGUF_PROJECTIONS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
NEAREST = {"int4": "q4_K", "int8": "q8_0", "bf16": "bf16", "f32": "f32"}  # our expert format -> llama.cpp's
TWIN = "twin.gguf"


def hf_expert_name(layer: int, expert: int, proj: str) -> str:
    """The per-expert name llama.cpp's converter reads (it merges a layer's experts itself)."""
    if proj not in PROJECTIONS:
        raise ValueError(f"unknown expert projection {proj!r}")
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def gguf_expert_name(layer: int, proj: str) -> str:
    """The merged tensor [experts, out, in] (numpy order) that holds `proj` of every expert of `layer`."""
    return f"blk.{layer}.{GGUF_PROJECTIONS[proj]}.weight"


def expert_projections(expert) -> dict[str, torch.Tensor]:
    """Our Expert (gate_up [2I, D] gate rows first, down [D, I]) as float32 HF projections."""
    gate_up = expert.gate_up.dequantize()
    inter = gate_up.shape[0] // 2
    return {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:], "down_proj": expert.down.dequantize()}


def projection_shapes(reader) -> dict[int, dict[str, tuple[int, int]]]:
    """Per MoE layer of the store: each projection's [out, in] (from its extent layout's meta)."""
    shapes = {}
    for layer, entry in reader.manifest.layers.items():
        gu, down = entry.layout.meta["gate_up"], entry.layout.meta["down"]
        inter = gu["out_features"] // 2
        shapes[layer] = {
            "gate_proj": (inter, gu["in_features"]),
            "up_proj": (inter, gu["in_features"]),
            "down_proj": (down["out_features"], down["in_features"]),
        }
    return shapes


def read_projection(reader, layer: int, expert: int, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """One projection of one expert, read (verified) from the store and dequantized to `dtype`."""
    extent = reader.read(layer, expert)
    part = "down" if proj == "down_proj" else "gate_up"
    meta = extent.layout.meta[part]
    rows = None
    if part == "gate_up":
        inter = meta["out_features"] // 2
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return part_rows(extent, part, rows).to(dtype).contiguous()


def part_rows(extent, part: str, rows: slice | None) -> torch.Tensor:
    """Rows of one Linear of an extent as float32 [rows, in]: int4 straight from its raw nibbles
    (no packing for this CPU), any other format through its codec."""
    from latentkv.experts.extent import _view, codec_for, int4_portable
    from latentkv.weights.int4 import dequantize_int4, unpack_nibbles

    meta = extent.layout.meta[part]
    raw = {name: _view(extent, f"{part}.{name}") for name in meta["tensors"]}
    rows = rows or slice(0, meta["out_features"])
    if meta["format"] == "int4":
        nibbles, scale, zero = int4_portable(meta["params"], raw)
        w = dequantize_int4(unpack_nibbles(nibbles[rows]), scale[rows], zero[rows])
        return w[:, : meta["in_features"]]
    lin = codec_for(meta["format"]).from_raw(meta["format"], meta["params"], raw)
    return lin.dequantize()[rows]


# --- the converter, run in a child with llama.cpp's gguf-py on the path ---------------------------

_INNER = """
import sys
sys.path.insert(0, {bench!r})
import expert_twin
expert_twin.convert_inner(*sys.argv[1:])
"""


def hf_view(model_dir: Path, work: Path, tokenizer_from: Path) -> Path:
    """A folder of links to the dense checkpoint plus a donor tokenizer (the converter's input)."""
    view = work / "hf-view"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and (f.suffix in (".safetensors", ".json") and not f.name.startswith("tokenizer")):
            (view / f.name).symlink_to(f.resolve())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (tokenizer_from / name).is_file():
            raise SystemExit(f"expert_twin: {tokenizer_from} has no {name} (the converter needs a tokenizer)")
        shutil.copy2(tokenizer_from / name, view / name)
    return view


def convert_inner(view: str, store: str, out: str) -> None:
    """llama.cpp's converter on the dense view, with the store's experts added as lazy f16 tensors
    and every tensor but the experts kept float32 (as our checkpoint has them)."""
    sys.path.insert(0, str(llamacpp.source_dir()))
    import convert_hf_to_gguf as conv
    from conversion import base
    from conversion.glm import GlmMoeDsaModel

    from latentkv.experts.reader import ExpertReader

    reader = ExpertReader(store, direct=None, threads=1)
    shapes = projection_shapes(reader)
    lazy_cls = base.LazyTorchTensor

    def lazy(layer: int, e: int, proj: str) -> torch.Tensor:
        meta = lazy_cls.meta_with_dtype_and_shape(torch.float16, shapes[layer][proj])
        key = (layer, e, proj)
        return lazy_cls(meta=meta, args=(key,), func=lambda k: read_projection(reader, *k, torch.float16))

    original_index = GlmMoeDsaModel.index_tensors

    def index_tensors(self, remote_hf_model_id=None):
        tensors = original_index(self, remote_hf_model_id)
        for layer, entry in sorted(reader.manifest.layers.items()):
            for e in range(entry.n_experts):
                for proj in PROJECTIONS:
                    tensors[hf_expert_name(layer, e, proj)] = lambda k=(layer, e, proj): lazy(*k)
        return tensors

    def force_quant(self, name, new_name, bid, n_dims):
        return False if "_exps" in new_name else conv.gguf.GGMLQuantizationType.F32

    GlmMoeDsaModel.index_tensors = index_tensors
    GlmMoeDsaModel.tensor_force_quant = force_quant
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
    base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
    sys.argv = ["convert_hf_to_gguf.py", view, "--outfile", out, "--outtype", "f16"]
    conv.main()
    reader.close()


def _disk_used(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def quantize_cmd(src: Path, dst: Path, quant: str, threads: int) -> list[str]:
    """llama-quantize: the `_exps` tensors to `quant`, every other tensor copied as it is (f32)."""
    q = str(llamacpp.binary("llama-quantize"))
    rules = ["--tensor-type", f"_exps={quant.lower()}", "--tensor-type", ".=f32"]
    return [q, *rules, str(src), str(dst), "Q4_K_M", str(threads)]


def build_twin(model_dir: Path, out_dir: Path, tokenizer_from: Path = FIXTURE, threads: int = 2) -> dict:
    """Convert (experts f16) then quantize the experts; returns what twin.json records."""
    from latentkv.experts.store_file import read_manifest
    from latentkv.streaming.planner import EXPERTS_DIR

    store = model_dir / EXPERTS_DIR
    manifest = read_manifest(store)
    ours = manifest.meta.get("weight_format", "int4")
    quant = NEAREST.get(ours)
    if quant is None:
        raise SystemExit(f"expert_twin: no llama.cpp format stands for our {ours!r} experts")
    out_dir.mkdir(parents=True, exist_ok=True)
    view = hf_view(model_dir, out_dir, tokenizer_from)
    f16 = out_dir / "experts-f16.gguf"
    env = llamacpp.converter_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env["PYTHONPATH"]])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the converter's tokenizer: local only
    t0 = time.perf_counter()
    inner = _INNER.format(bench=str(Path(__file__).parent))
    subprocess.run(
        ["nice", "-n", "10", sys.executable, "-c", inner, str(view), str(store), str(f16)],
        check=True,
        env=env,
    )
    convert_s = time.perf_counter() - t0
    peak = _disk_used(out_dir)
    twin = out_dir / TWIN
    t0 = time.perf_counter()
    subprocess.run(["nice", "-n", "10", *quantize_cmd(f16, twin, quant, threads)], check=True)
    peak = max(peak, _disk_used(out_dir))
    f16_bytes = f16.stat().st_size
    f16.unlink()
    shutil.rmtree(view)
    info = {
        "model": str(model_dir),
        "gguf": str(twin),
        "ours_expert_format": ours,
        "llamacpp_expert_format": quant,
        "dense_format": "f32",
        "ours_expert_bytes": manifest.expert_bytes,
        "gguf_bytes": twin.stat().st_size,
        "f16_intermediate_bytes": f16_bytes,
        "peak_disk_bytes": peak,
        "convert_s": convert_s,
        "quantize_s": time.perf_counter() - t0,
        "llamacpp_version": llamacpp.version(),
    }
    info.update(gguf_expert_bytes=gguf_tensor_bytes(twin, "_exps"))
    (out_dir / "twin.json").write_text(json.dumps(info, indent=1))
    return info


# --- reading the twin back ----------------------------------------------------------------------


def _gguf():
    sys.path.insert(0, str(llamacpp.source_dir() / "gguf-py"))
    import gguf

    return gguf


def gguf_tensor_bytes(path: Path, contains: str) -> int:
    gguf = _gguf()
    r = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in r.tensors if contains in t.name)


def _dequantize(gguf, tensor, expert: int) -> torch.Tensor:
    """One expert's slice of a merged GGUF tensor, dequantized to float32."""
    return torch.from_numpy(gguf.quants.dequantize(tensor.data[expert], tensor.tensor_type).copy()).float()


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def verify_twin(gguf_path: Path, store: Path, experts: list[tuple[int, int]]) -> list[dict]:
    """For some (layer, expert): the twin's dequantized projections vs the store's (float32).
    Reports the relative RMS error (Q4_K re-quantizing our int4 values: a few percent)."""
    from latentkv.experts.reader import ExpertReader

    gguf = _gguf()
    r = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in r.tensors}
    rows = []
    with ExpertReader(store, direct=None, threads=1) as reader:
        for layer, e in experts:
            for proj in PROJECTIONS:
                t = by_name[gguf_expert_name(layer, proj)]
                ours = read_projection(reader, layer, e, proj, torch.float32)
                theirs = _dequantize(gguf, t, e).reshape(ours.shape)
                # control: the same tensor's next expert, so a wrong mapping cannot pass
                other = _dequantize(gguf, t, (e + 1) % t.data.shape[0]).reshape(ours.shape)
                rows.append(
                    {
                        "layer": layer,
                        "expert": e,
                        "proj": proj,
                        "type": t.tensor_type.name,
                        "rel_rms": _rel_rms(theirs, ours),
                        "rel_rms_other_expert": _rel_rms(other, ours),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="the benchmark model (config.json, safetensors, experts/)")
    p.add_argument("out", type=Path, help="the twin's folder (twin.gguf, twin.json)")
    p.add_argument("--tokenizer-from", type=Path, default=FIXTURE)
    p.add_argument("--threads", type=int, default=2, help="llama-quantize threads (default: 2)")
    p.add_argument("--verify", action="store_true", help="compare some experts of an existing twin")
    args = p.parse_args(argv)
    if not (args.model / "experts").is_dir():
        print(
            f"expert_twin: {args.model} has no experts/ (build it with build_expert_model.py)",
            file=sys.stderr,
        )
        return 2
    if args.verify:
        from latentkv.experts.store_file import read_manifest

        layers = read_manifest(args.model / "experts").layers
        first, last = min(layers), max(layers)
        picks = [(first, 0), (last, layers[last].n_experts - 1)]
        rows = verify_twin(args.out / TWIN, args.model / "experts", picks)
        print(json.dumps(rows, indent=1))
        return 0 if all(r["rel_rms"] < 0.1 < r["rel_rms_other_expert"] for r in rows) else 1
    info = build_twin(args.model, args.out, args.tokenizer_from, args.threads)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
