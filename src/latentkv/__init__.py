"""latentkv: MLA mixture-of-experts models with a compressed latent KV cache."""

from __future__ import annotations


def version() -> str:
    """The installed package's version ('unknown' when run from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("latentkv")
    except PackageNotFoundError:
        return "unknown"
