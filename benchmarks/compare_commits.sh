#!/usr/bin/env bash
# Speed of two commits side by side, on one idle machine: the issue-14 check that the one
# forward (models/batch.py) costs nothing. Each commit is checked out into its own worktree and
# installed into this checkout's venv in turn (editable), then timed with the same commands.
#
#   bash benchmarks/compare_commits.sh OLD NEW        # e.g. b88308c i14
#
# Writes benchmarks/results/compare-<commit>-<bench>.json for each; prints the decode tok/s side
# by side. Rows within 3% are noise on a 2-core VM; run it twice and keep the better of each.
set -euo pipefail
old=${1:?old commit}; new=${2:?new commit}
root=$(git rev-parse --show-toplevel)
py=$root/.venv/bin/python
out=$root/benchmarks/results
mkdir -p "$out"
for rev in "$old" "$new"; do
  sha=$(git rev-parse --short "$rev")
  tree=$(mktemp -d)/latentkv-$sha
  git worktree add -q --detach "$tree" "$rev"
  for bench in \
    "tiny:decode builtin:tiny --context 128,1024 --decode-tokens 128 --repeats 3 --threads 1" \
    "batch8:batch builtin:tiny --batch 8 --context 128 --steps 128 --threads 1 --kv-cache-dtype f32,bf16,tq4" \
    "fixture:decode builtin:fixture --context 128 --decode-tokens 64 --repeats 3 --threads 2" \
    "slice1k:decode builtin:slice --context 1024 --decode-tokens 16 --repeats 3 --threads 2"; do
    name=${bench%%:*}; args=${bench#*:}
    # shellcheck disable=SC2086
    (cd "$tree" && PYTHONPATH="$tree/src" "$py" -m latentkv bench $args --json --out "$out/compare-$sha-$name.json" >/dev/null)
    echo "$sha $name done"
  done
  git worktree remove --force "$tree"
done
"$py" - "$out" "$(git rev-parse --short "$old")" "$(git rev-parse --short "$new")" <<'PY'
import json, sys
from pathlib import Path
out, old, new = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def rows(sha, name):
    return json.loads((out / f"compare-{sha}-{name}.json").read_text())["rows"]
print(f"| bench | row | {old} tok/s | {new} tok/s | new/old |")
print("|---|---|---|---|---|")
for name in ("tiny", "batch8", "fixture", "slice1k"):
    for a, b in zip(rows(old, name), rows(new, name), strict=True):
        field = "decode_tps" if "decode_tps" in a else "aggregate_tps"
        row = f"{a['kv_cache_dtype']} ctx {a['context']}" + (f" B={a['batch']}" if "batch" in a else "")
        print(f"| {name} | {row} | {a[field]:.1f} | {b[field]:.1f} | {b[field] / a[field]:.3f} |")
PY
