"""The model folder that stands for a GGUF file: what MODEL = x.gguf resolves to.

Made once per GGUF (its shards' paths, sizes and modification times name it) under the cache
directory, `gguf/NAME-KEY/`: config.json from the metadata, tokenizer.json and
tokenizer_config.json from the tokenizer metadata (or `tokenizer-problem.txt` saying why there
is none), the manifest of the quantized matrices (`latentkv-weights.json`, "source": "gguf")
and, written last, `latentkv-gguf.json` naming the shards. The weights stay in the GGUF:
`Checkpoint` reads them from there (models/gguf.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from latentkv.models.convert import FORMAT, MANIFEST, VERSION
from latentkv.models.gguf import (
    VIEW_FORMAT,
    VIEW_VERSION,
    GgufModel,
    GgufSource,
    hf_config,
    shard_paths,
)
from latentkv.models.gguf_vocab import VocabError, tokenizer_files
from latentkv.models.loader import GGUF_POINTER as POINTER
from latentkv.weights.gguf_blocks import EXACT


def fingerprint_view(paths: list[Path]) -> str:
    """What names a GGUF's view folder: its shards' paths, sizes and modification times, and
    what shapes the folder here (the view's version, the types mapped exactly)."""
    digest = hashlib.sha256(f"{VIEW_VERSION}\0{sorted(EXACT.items())}\0".encode())
    for p in paths:
        st = p.stat()
        digest.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def view(path: Path, cache: Path) -> Path:
    """The model folder standing for the GGUF at `path` (the first shard), made on first use
    under `cache`/gguf/: config.json, the tokenizer's files, the manifest and the pointer."""
    paths = shard_paths(path)
    key = fingerprint_view(paths)
    folder = cache / "gguf" / f"{paths[0].name.removesuffix('.gguf')[:80]}-{key[:16]}"
    pointer = folder / POINTER
    if pointer.exists():
        try:
            if json.loads(pointer.read_text()).get("key") == key:
                return folder
        except (OSError, json.JSONDecodeError):
            pass
    model = GgufModel(paths)
    cfg = hf_config(model)
    source = GgufSource(model, cfg)
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"config.json": cfg}
    try:
        files.update(tokenizer_files(model.meta))
    except VocabError as exc:
        files["tokenizer-problem.txt"] = str(exc)
    files[MANIFEST] = {
        "format": FORMAT,
        "version": VERSION,
        "source": "gguf",
        "weight_dtype": None,
        "expert_dtype": None,
        "tensors": source.packed,
        "experts": {},
    }
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=1, ensure_ascii=False)
        (folder / name).write_text(text, encoding="utf-8")
    pointer_doc = {
        "format": VIEW_FORMAT,
        "version": VIEW_VERSION,
        "key": key,
        "shards": [str(p.resolve()) for p in paths],
    }
    (folder / POINTER).write_text(json.dumps(pointer_doc, indent=1))  # last: a complete folder has it
    return folder
