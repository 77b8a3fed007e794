#!/usr/bin/env bash
# Speed of two commits side by side, on one idle machine: the issue-14 check that the one
# forward (models/batch.py) costs nothing. Each commit is checked out into its own worktree and
# run with this checkout's venv (or $PYTHON; its own src/ first on PYTHONPATH), with the same commands.
#
#   bash benchmarks/compare_commits.sh OLD NEW [ROUNDS]     # e.g. b88308c main 3
#   ONLY="formats tiny-hf" bash benchmarks/compare_commits.sh OLD NEW 5   # some benches only
#
# The two commits are interleaved: every round runs each bench for OLD and then NEW (the order
# flips every other round), so a slow minute of a shared VM hits both. Each row keeps its best
# round (the least disturbed) and the median over the rounds with their min-max, which says how
# much of a difference is noise. Writes benchmarks/results/compare-<commit>-<bench>-r<round>.json
# and prints one table. ONLY picks benches by name (default: tiny batch8 fixture slice1k);
# "formats" is the fixture per weight format, "tiny-hf" tiny beside transformers' eager decode.
set -euo pipefail
old=${1:?old commit}; new=${2:?new commit}; rounds=${3:-3}
only=${ONLY:-tiny batch8 fixture slice1k}
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
out=$root/benchmarks/results
mkdir -p "$out"
benches=(
  "tiny:decode builtin:tiny --context 128,1024 --decode-tokens 128 --repeats 3 --threads 1"
  "batch8:batch builtin:tiny --batch 8 --context 128 --steps 128 --threads 1 --kv-cache-dtype f32,bf16,tq4"
  "fixture:decode builtin:fixture --context 128 --decode-tokens 64 --repeats 3 --threads 2"
  "slice1k:decode builtin:slice --context 1024 --decode-tokens 16 --repeats 3 --threads 2"
  "formats:decode builtin:fixture --weight-dtype f32,bf16,int8,int4 --context 128 --decode-tokens 64 --threads 2"
  "tiny-hf:decode builtin:tiny --context 128 --decode-tokens 64 --threads 1 --vs-transformers"
)
declare -A tree
for rev in "$old" "$new"; do
  sha=$(git rev-parse --short "$rev")
  tree[$sha]=$(mktemp -d)/latentkv-$sha
  git worktree add -q --detach "${tree[$sha]}" "$rev"
done
cleanup() { for t in "${tree[@]}"; do git worktree remove --force "$t" || true; done; }
trap cleanup EXIT
a=$(git rev-parse --short "$old"); b=$(git rev-parse --short "$new")
for ((r = 1; r <= rounds; r++)); do
  order=("$a" "$b"); ((r % 2 == 0)) && order=("$b" "$a")
  for bench in "${benches[@]}"; do
    name=${bench%%:*}; args=${bench#*:}
    [[ " $only " == *" $name "* ]] || continue
    for sha in "${order[@]}"; do
      # shellcheck disable=SC2086
      (cd "${tree[$sha]}" && PYTHONPATH="${tree[$sha]}/src" "$py" -m latentkv bench $args --json \
        --out "$out/compare-$sha-$name-r$r.json" >/dev/null)
      echo "round $r: $sha $name done" >&2
    done
  done
done
"$py" - "$out" "$a" "$b" "$rounds" "$only" <<'PY'
import json, statistics, sys
from pathlib import Path
out, old, new, rounds, only = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split()
def speeds(sha, name):
    per_round = [json.loads((out / f"compare-{sha}-{name}-r{r}.json").read_text())["rows"] for r in range(1, rounds + 1)]
    field = "decode_tps" if "decode_tps" in per_round[0][0] else "aggregate_tps"
    return per_round[0], [[row[field] for row in rows] for rows in zip(*per_round, strict=True)]
def cell(v):
    return f"{max(v):.1f} | {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
print(f"| bench | row | {old} best | {old} median (min-max) | {new} best | {new} median (min-max) | new/old (best) | new/old (median) |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for name in only:
    rows, olds = speeds(old, name)
    _, news = speeds(new, name)
    for row, o, n in zip(rows, olds, news, strict=True):
        label = f"{row.get('engine', 'latentkv')} {row.get('weight_dtype', '')} KV {row['kv_cache_dtype']} ctx {row['context']}"
        label += f" B={row['batch']}" if "batch" in row else ""
        ratio = statistics.median(n) / statistics.median(o)
        print(f"| {name} | {label} | {cell(o)} | {cell(n)} | {max(n) / max(o):.3f} | {ratio:.3f} |")
PY
