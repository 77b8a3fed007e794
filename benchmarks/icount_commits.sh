#!/usr/bin/env bash
# Instructions per decode step of two commits, counted by valgrind (cachegrind, no cache
# simulation): a before/after check of a refactor that other processes' load cannot disturb,
# unlike tok/s on a shared machine.
#
#   bash benchmarks/icount_commits.sh BASE HEAD [STEPS]     # e.g. main tier 16
#
# Each commit is checked out into its own worktree and run with this checkout's venv (its own
# src/ first on PYTHONPATH), one thread. Per (model, KV tier) the same script runs twice under
# valgrind: prefill 32 tokens and decode WARM steps, then the same plus STEPS more; the
# difference over STEPS is one decode step's instructions, with loading, imports, prefill and the
# first steps' one-time costs cancelled out. Writes benchmarks/results/icount-BASE-HEAD.json
# and prints one table. Takes a few minutes per run (Python and torch under valgrind).
set -euo pipefail
base=${1:?base commit}; head=${2:?head commit}; steps=${3:-16}
warm=4
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=/work/main/.venv/bin/python
out=$root/benchmarks/results
mkdir -p "$out"
cases=("builtin:tiny f32" "builtin:tiny q4s" "builtin:fixture f32")
work=$(mktemp -d)
declare -A tree
for rev in "$base" "$head"; do
  sha=$(git rev-parse --short "$rev")
  tree[$sha]=$work/latentkv-$sha
  git worktree add -q --detach "${tree[$sha]}" "$rev"
done
cleanup() { for t in "${tree[@]}"; do git worktree remove --force "$t" || true; done; rm -rf "$work"; }
trap cleanup EXIT
a=$(git rev-parse --short "$base"); b=$(git rev-parse --short "$head")

# The driver uses only what both commits have: runtime.load, Model.forward and make_cache (a
# KV tier through Model.tier where the commit has it, else the CacheConfig itself).
driver='
import sys, torch
from latentkv.config import CacheConfig, EngineConfig
from latentkv.runtime import load
name, tier, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load(name, EngineConfig(threads=1), quiet=True).model
cfg = CacheConfig(tier)
cache = model.make_cache(model.tier(cfg) if hasattr(model, "tier") else cfg)
g = torch.Generator().manual_seed(0)
logits = model.forward(torch.randint(2, model.cfg.vocab_size, (32,), generator=g), cache)
for _ in range(n):
    logits = model.forward(logits[-1].argmax().view(1), cache)
print(int(logits[-1].argmax()))
'

count() {  # count SHA MODEL TIER N -> total instructions (Ir) of the run
  local file=$work/cg.$$.$RANDOM
  (cd "${tree[$1]}" && PYTHONPATH="${tree[$1]}/src" OMP_NUM_THREADS=1 valgrind --tool=cachegrind \
    --cache-sim=no --cachegrind-out-file="$file" "$py" -c "$driver" "$2" "$3" "$4" >/dev/null 2>&1)
  awk '/^summary:/ {print $2}' "$file"
}

rows=()
for c in "${cases[@]}"; do
  read -r model tier <<<"$c"
  for sha in "$a" "$b"; do
    lo=$(count "$sha" "$model" "$tier" "$warm")
    hi=$(count "$sha" "$model" "$tier" $((warm + steps)))
    rows+=("$sha $model $tier $lo $hi")
    echo "$sha $model $tier: $(((hi - lo) / steps)) instructions per decode step" >&2
  done
done

printf '%s\n' "${rows[@]}" | "$py" - "$out/icount-$a-$b.json" "$a" "$b" "$steps" "$warm" <<'PY'
import json, sys
path, base, head, steps, warm = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
per = {}
for line in sys.stdin.read().split("\n"):
    if line.strip():
        sha, model, tier, lo, hi = line.split()
        per[(model, tier, sha)] = (int(hi) - int(lo)) / steps
rows = []
print(f"| model | KV tier | {base} instr/step | {head} instr/step | head/base |")
print("|---|---|---:|---:|---:|")
for model, tier in dict.fromkeys((m, t) for m, t, _ in per):
    old, new = per[(model, tier, base)], per[(model, tier, head)]
    rows.append({"model": model, "kv_cache_dtype": tier, "base": round(old), "head": round(new), "ratio": new / old})
    print(f"| {model} | {tier} | {old:,.0f} | {new:,.0f} | {new / old:.4f} |")
meta = {"base": base, "head": head, "steps": steps, "warm_steps": warm, "threads": 1, "prefill": 32,
        "tool": "valgrind --tool=cachegrind --cache-sim=no (Ir), (run of warm+steps) - (run of warm)"}
with open(path, "w") as f:
    json.dump({**meta, "rows": rows}, f, indent=1)
    f.write("\n")
PY
