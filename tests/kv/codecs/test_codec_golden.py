"""Golden bytes: every codec's encoding of a fixed input, pinned to the KV file's codec revision.

A KV file records each codec's `params()` and `CODEC_REVISION`; a reader trusts them to mean
"these exact bytes". If a change to a codec alters its bytes without changing its params, old
files would be misread. This test pins the SHA-256 of each codec's codes and scales for a fixed,
closed-form input (no RNG involved). When it fails after a deliberate format change: bump
`CODEC_REVISION` in `latentkv/kv/store_header.py`, then re-record with
`python tests/kv/codecs/test_codec_golden.py --record`.

Why these bytes may be compared exactly on any x86-64 CPU (unlike float logits): no codec calls
BLAS (no MKL or oneDNN: no matmul; the Hadamard rotation is butterfly adds), so the only kernels
involved are ATen's, chosen by torch's CPU capability alone, not by vendor. The ops are IEEE
exact-rounded elementwise ones, float64 reductions (row norms) and a few transcendentals
(sin/exp of the input, atan2 in polar*, the Lloyd codebooks), whose last-bit differences between
capabilities would have to land on an f32 rounding edge or a code boundary to move a byte. Every
capability torch has on x86-64 gives these bytes: recorded on an AMD EPYC (AVX2), verified on an
Intel Xeon under AVX512, ATEN_CPU_CAPABILITY=avx2 and =default (the scalar kernels), and with
MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2, with torch 2.13 (`make setup`'s pin). CI runs this
test under the default capability too (`.ci/run`), so a kernel-dependent byte shows there first.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from latentkv.kv.codecs import CODEC_NAMES, get_codec
from latentkv.kv.store_header import CODEC_REVISION

GOLDEN = Path(__file__).parent.parent.parent / "data" / "codec_golden.json"
WIDTHS = (64, 512)
# Grouped radii of the rotated codecs: their params carry group_size, so they are new formats
# beside the per-row ones (whose digests must not move). Keyed "tq4-g16/512".
GROUPED = [
    *((f"tq{b}", 16) for b in range(2, 7)),
    *((f"polar{b}", 16) for b in range(2, 7)),
    ("tq4", 64),
    ("tq4", 8),
    ("polar4", 2),
    ("polar4", 64),
]


def golden_rows(width: int) -> torch.Tensor:
    """16 rows of varied shape and scale, from sines (exactly reproducible), plus an inert row."""
    i = torch.arange(16, dtype=torch.float64)[:, None]
    j = torch.arange(width, dtype=torch.float64)[None, :]
    rows = torch.sin(0.37 * j * (i + 1) + i) * torch.exp(0.25 * (i - 8)) + 0.1 * torch.cos(j / (i + 3))
    rows[5] = 0.0  # an inert row
    return rows.float()


def digest(name: str, width: int, group: int | None = None) -> str:
    enc = get_codec(name, width, group_size=group).encode(golden_rows(width))
    h = hashlib.sha256()
    h.update(enc.codes.contiguous().numpy().tobytes())
    h.update(enc.scales.contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.numerics
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codec_bytes_match_the_recorded_revision(name, width):
    recorded = json.loads(GOLDEN.read_text())
    assert recorded["codec_revision"] == CODEC_REVISION, (
        "CODEC_REVISION changed: re-record the golden bytes for the new revision"
    )
    assert digest(name, width) == recorded["digests"][f"{name}/{width}"], (
        f"{name} at width {width} now encodes different bytes: bump CODEC_REVISION and re-record"
    )


@pytest.mark.numerics
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("name", "group"), GROUPED)
def test_grouped_codec_bytes_match_the_recorded_revision(name, group, width):
    recorded = json.loads(GOLDEN.read_text())
    assert recorded["codec_revision"] == CODEC_REVISION
    assert digest(name, width, group) == recorded["digests"][f"{name}-g{group}/{width}"], (
        f"{name} with groups of {group} at width {width} now encodes different bytes: bump CODEC_REVISION"
    )


def test_golden_input_is_what_it_claims():
    rows = golden_rows(64)
    assert rows.shape == (16, 64) and torch.all(rows[5] == 0)
    assert math.isfinite(float(rows.abs().max())) and float(rows.abs().max()) > 1.0


if __name__ == "__main__" and "--record" in sys.argv:
    out = {
        "codec_revision": CODEC_REVISION,
        "digests": {
            **{f"{n}/{w}": digest(n, w) for n in CODEC_NAMES for w in WIDTHS},
            **{f"{n}-g{g}/{w}": digest(n, w, g) for n, g in GROUPED for w in WIDTHS},
        },
    }
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    print(f"recorded {len(out['digests'])} digests at codec revision {CODEC_REVISION}")
