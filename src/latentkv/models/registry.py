"""Where models come from: a directory, or `builtin:NAME` for the checkpoints we ship."""

from __future__ import annotations

from pathlib import Path

from latentkv.config import cache_root

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTINS = {
    "tiny": "GLM-5 architecture, random weights, the seed system's oracle shape (7M parameters, byte tokenizer)",
}


class ModelNotFound(ValueError):
    pass


def builtin_path(name: str) -> Path:
    if name not in BUILTINS:
        raise ModelNotFound(f"unknown builtin model {name!r}; available: {', '.join('builtin:' + n for n in BUILTINS)}")
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
