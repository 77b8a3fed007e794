"""What machine and which checkout a benchmark ran on, for its results JSON: one reader of
/proc/cpuinfo and git for every benchmark (import it beside the script: benchmarks/ is on
sys.path when a benchmark runs as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the flag families that decide which kernels run (AVX-512 VNNI/BF16, AMX, AVX2, FMA, ...)
KERNEL_FLAGS = ("avx", "amx", "fma", "f16c", "sse4", "bmi")


def _cpuinfo() -> dict[str, str]:
    """The first CPU's "key: value" lines of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block only
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ..."), else what platform knows."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU flags that decide which kernels run (KERNEL_FLAGS' families)."""
    return [f for f in _cpuinfo().get("flags", "").split() if f.startswith(KERNEL_FLAGS)]


def commit(paths: tuple[str, ...] = ()) -> str | None:
    """The checkout's commit, with "+changes" when its tracked files (under `paths`, all when
    empty) differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", *paths],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
