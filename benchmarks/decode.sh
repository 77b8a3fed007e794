#!/usr/bin/env bash
# The decode benchmark behind docs/performance.md: latentkv beside transformers' generate(),
# same checkpoint, same thread count, one run per model. Writes JSON to benchmarks/results/.
# Run on an otherwise idle machine (check `uptime`): a concurrent job distorts both columns.
set -euo pipefail
cd "$(dirname "$0")/.."
LATENTKV=${LATENTKV:-.venv/bin/latentkv}
THREADS=${THREADS:-2}
OUT=benchmarks/results
mkdir -p "$OUT"

"$LATENTKV" bench decode builtin:tiny --context 128,1024 --decode-tokens 128 --repeats 3 \
    --vs-transformers --threads "$THREADS" --out "$OUT/decode-tiny.json"
"$LATENTKV" bench decode builtin:slice --context 128,1024,2048 --decode-tokens 16 --repeats 2 \
    --weight-dtype f32,bf16 --vs-transformers --threads "$THREADS" --out "$OUT/decode-slice.json"
