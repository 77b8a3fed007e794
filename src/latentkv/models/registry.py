"""Where models come from: a directory, `builtin:NAME` for the checkpoints we ship, or a Hugging
Face repo id (`org/name[@revision]`) found in the local hub cache (`models/hub.py`)."""

from __future__ import annotations

from pathlib import Path

from latentkv.config import cache_root, hf_hub_cache

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTINS = {
    "fixture": "GLM-5 architecture trained on the Python standard library (9.5M parameters incl. one MTP layer, "
    "4096-entry BPE; tools/train_fixture.py); the model for quality numbers and the demo",
    "tiny": "GLM-5 architecture, random weights, the seed system's oracle shape (1.2M parameters, byte tokenizer)",
    "slice": "GLM-5's real attention widths, 2 layers, 8 experts, random weights (1.1B parameters; "
    "built into the cache directory on first use, 4.4 GB)",
    "stdlib-moe": "GLM-5 architecture trained on the Python standard library: 6 layers, 64 experts top-8 + shared, "
    "DSA, one MTP layer, context 4096 (24M parameters; tools/train_moe.py); learned routing, no long-context recall",
}
BUILT_ON_DEMAND = {"slice"}


class ModelNotFound(ValueError):
    pass


def builtin_path(name: str) -> Path:
    if name not in BUILTINS:
        raise ModelNotFound(
            f"unknown builtin model {name!r}; available: {', '.join('builtin:' + n for n in BUILTINS)}"
        )
    if name in BUILT_ON_DEMAND:
        from latentkv.models.synthetic import ensure_slice

        return ensure_slice(cache_root())
    return BUILTIN_DIR / name


def resolve(model: str) -> Path:
    """MODEL argument -> a directory holding config.json and safetensors."""
    from latentkv.models import hub

    if model.startswith("builtin:"):
        path = builtin_path(model.removeprefix("builtin:"))
    else:
        path = Path(model).expanduser()
        if not path.exists() and (repo := hub.parse_repo_id(model)) is not None:
            try:
                path = hub.cached_snapshot(*repo, hf_hub_cache())
            except hub.NotCached as exc:
                raise ModelNotFound(f"model {model!r} is not a directory here, and {exc}") from None
        if path.is_dir() and not (path / "config.json").exists() and (found := _gguf_in(path)) is not None:
            path = found  # a Hugging Face repo (or folder) of GGUF files: its one model
        if path.is_file() and path.suffix == ".gguf":
            return gguf_folder(path)
    if not path.is_dir():
        raise ModelNotFound(
            f"model {model!r} is not a directory; give a directory with config.json and *.safetensors, "
            f"a Hugging Face repo id in the local cache (org/name[@revision]), "
            f"or one of: {', '.join('builtin:' + n for n in BUILTINS)}"
        )
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} has no config.json")
    return path


def gguf_folder(path: Path) -> Path:
    """The model folder standing for a GGUF file (made on first use: models/gguf_view.py)."""
    from latentkv.models.gguf import GgufError
    from latentkv.models.gguf_view import view

    try:
        return view(path, cache_root())
    except GgufError as exc:
        raise ModelNotFound(str(exc)) from None
    except OSError as exc:
        raise ModelNotFound(f"{path}: cannot read it: {exc.strerror or exc}") from None


def _gguf_in(folder: Path) -> Path | None:
    """The GGUF model in a folder without config.json (a GGUF repository's snapshot): its single
    .gguf file or the first shard of its one split set; None when there is none; ModelNotFound
    listing them when there are several."""
    from latentkv.models.gguf import SHARD

    files = sorted(folder.rglob("*.gguf"))
    models = [f for f in files if (m := SHARD.match(f.name)) is None or int(m["no"]) == 1]
    models = [f for f in models if not f.name.startswith("mmproj")]
    if len(models) > 1:
        names = ", ".join(str(f.relative_to(folder)) for f in models[:6])
        raise ModelNotFound(f"{folder} holds {len(models)} GGUF models ({names}); give the path of one")
    return models[0] if models else None


__all__ = ["BUILTINS", "ModelNotFound", "builtin_path", "cache_root", "gguf_folder", "resolve"]
