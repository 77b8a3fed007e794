"""MODEL as a Hugging Face repo id (`org/name` or `org/name@revision`), found in the local cache.

`hf download zai-org/GLM-5` puts a model in the hub cache (HF_HUB_CACHE, else HF_HOME/hub,
else ~/.cache/huggingface/hub: `config.hf_hub_cache`). This module finds the snapshot there
through huggingface_hub with `local_files_only=True`: never a network call. A repo id that is
not cached is one line naming where it looked and the command that would fetch it.

A local path always wins: `org/name` is a repo id only when no such file or folder exists here.
"""

from __future__ import annotations

import re
from pathlib import Path

# The owner and the name as the hub allows them (letters, digits, -, _, .; 96 characters at
# most), then an optional @revision: a branch, a tag or a commit hash.
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]{1,200}))?$")


class NotCached(ValueError):
    """A repo id that is not in the local cache; the message names the cache and the command."""


def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) when `text` reads as a repo id, else None."""
    match = REPO_ID.match(text)
    if match is None or ".." in match["repo"] or match["repo"].endswith("."):
        return None
    return match["repo"], match["revision"]


def fetch_command(repo: str, revision: str | None) -> str:
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def cached_snapshot(repo: str, revision: str | None, cache: Path) -> Path:
    """The cached snapshot folder of `repo` at `revision` (default: main) in `cache`.
    NotCached when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        what = f"revision {revision!r} of {repo}" if revision else repo
        raise NotCached(
            f"{what} is not in the Hugging Face cache at {cache} (HF_HUB_CACHE / HF_HOME); "
            f"fetch it with `{fetch_command(repo, revision)}` (latentkv never downloads)"
        ) from None
    return Path(folder)
