#!/usr/bin/env bash
# Instructions per decode step of two commits, counted by valgrind (callgrind): a before/after
# check of a refactor that other processes' load cannot disturb, unlike tok/s on a shared machine.
#
#   bash benchmarks/icount_commits.sh BASE HEAD [STEPS]     # e.g. main tier 16
#   MODELS="builtin:fixture f32 int8;builtin:fixture f32 int4" bash benchmarks/icount_commits.sh ...
#
# MODELS: ';'-separated "MODEL TIERS [WEIGHT_DTYPE]" (default: tiny and the fixture, f32 weights).
# Each commit is checked out into its own worktree and run with this checkout's venv (its own
# src/ first on PYTHONPATH), on one thread. Per model one process runs every KV tier: load,
# prefill 32 tokens, 4 warm-up decode steps, then STEPS decode steps counted. Callgrind starts
# with instrumentation off and a tiny C helper (built here from valgrind/callgrind.h) switches it
# on around the counted steps only, so loading, imports and prefill cost nothing and are not
# counted. Writes benchmarks/results/icount-BASE-HEAD.json and prints one table.
set -euo pipefail
base=${1:?base commit}; head=${2:?head commit}; steps=${3:-16}
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=/work/main/.venv/bin/python
out=$root/benchmarks/results
mkdir -p "$out"
IFS=';' read -r -a models <<<"${MODELS:-builtin:tiny f32,q4s,tq4;builtin:fixture f32,q4s}"
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

cat >"$work/toggle.c" <<'C'
#include <valgrind/callgrind.h>
void lkv_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void lkv_stop(const char *name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
C
cc -O2 -shared -fPIC -o "$work/toggle.so" "$work/toggle.c"

# The driver uses only what both commits have: runtime.load, Model.forward and make_cache (a
# KV tier through Model.tier where the commit has it, else the CacheConfig itself).
driver='
import ctypes, sys, torch
from latentkv.config import CacheConfig, EngineConfig
from latentkv.runtime import load
toggle = ctypes.CDLL(sys.argv[1])
name, tiers, steps, weights = sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5]
model = load(name, EngineConfig(threads=1, weight_dtype=weights), quiet=True).model
for tier in tiers:
    cfg = CacheConfig(tier)
    cache = model.make_cache(model.tier(cfg) if hasattr(model, "tier") else cfg)
    g = torch.Generator().manual_seed(0)
    logits = model.forward(torch.randint(2, model.cfg.vocab_size, (32,), generator=g), cache)
    token = logits[-1].argmax().view(1)
    for _ in range(4):
        token = model.forward(token, cache)[-1].argmax().view(1)
    toggle.lkv_start()
    for _ in range(steps):
        token = model.forward(token, cache)[-1].argmax().view(1)
    toggle.lkv_stop(tier.encode())
'

rows=()
for m in "${models[@]}"; do
  read -r model tiers weights <<<"$m"
  weights=${weights:-f32}
  for sha in "$a" "$b"; do
    dir=$work/cg-$sha-${model#builtin:}-$weights
    mkdir -p "$dir"
    (cd "${tree[$sha]}" && PYTHONPATH="${tree[$sha]}/src" OMP_NUM_THREADS=1 valgrind --tool=callgrind \
      --instr-atstart=no --callgrind-out-file="$dir/cg.%p" "$py" -c "$driver" "$work/toggle.so" \
      "$model" "$tiers" "$steps" "$weights" >/dev/null 2>"$dir/valgrind.log") || { cat "$dir/valgrind.log" >&2; exit 1; }
    for f in "$dir"/cg.*.*; do  # one dump per tier: its trigger names the tier
      tier=$(sed -n 's/^desc: Trigger: Client Request: //p' "$f")
      total=$(awk '/^totals:/ {print $2}' "$f")
      [ -n "$tier" ] && [ -n "$total" ] && rows+=("$sha $model/$weights $tier $total")
    done
    echo "$sha $model done" >&2
  done
done

printf '%s\n' "${rows[@]}" >"$work/rows.txt"
"$py" - "$work/rows.txt" "$out/icount-$a-$b.json" "$a" "$b" "$steps" <<'PY'
import json, sys
rows_file, path, base, head, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
per = {}
for line in open(rows_file).read().split("\n"):
    if line.strip():
        sha, model, tier, total = line.split()
        per[(model, tier, sha)] = int(total) / steps
rows = []
print(f"| model | KV tier | {base} instructions/step | {head} instructions/step | head/base |")
print("|---|---|---:|---:|---:|")
for model, tier in dict.fromkeys((m, t) for m, t, _ in per):
    old, new = per[(model, tier, base)], per[(model, tier, head)]
    rows.append({"model": model, "kv_cache_dtype": tier, "base": round(old), "head": round(new), "ratio": new / old})
    print(f"| {model} | {tier} | {old:,.0f} | {new:,.0f} | {new / old:.4f} |")
meta = {"base": base, "head": head, "steps": steps, "threads": 1, "prefill": 32, "warm_steps": 4,
        "tool": "valgrind --tool=callgrind --instr-atstart=no, instrumented around the counted steps (Ir)"}
with open(path, "w") as f:
    json.dump({**meta, "rows": rows}, f, indent=1)
    f.write("\n")
PY
