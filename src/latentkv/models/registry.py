"""Where models come from: a directory, or `builtin:NAME` for the checkpoints we ship."""

from __future__ import annotations

from pathlib import Path

from latentkv.config import cache_root

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
    if model.startswith("builtin:"):
        path = builtin_path(model.removeprefix("builtin:"))
    else:
        path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFound(
            f"model {model!r} is not a directory; give a directory with config.json and *.safetensors, "
            f"or one of: {', '.join('builtin:' + n for n in BUILTINS)}"
        )
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} has no config.json")
    return path


__all__ = ["BUILTINS", "ModelNotFound", "builtin_path", "cache_root", "resolve"]
