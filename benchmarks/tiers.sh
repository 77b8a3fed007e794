#!/usr/bin/env bash
# The KV-tier benchmarks behind docs/performance.md (issue 3): on the slice model, decode tok/s of
# every tier beside f32 in one run at long contexts, with the measured KV bytes beside the
# predicted ones; then the attention-only read at 32k tokens with GLM-5's widths (64 heads).
# The contexts are built with --fill random (rows appended straight to the cache: a 16k prefill of
# the slice takes minutes per tier on a small box; decode speed does not depend on the rows).
# Writes JSON and the markdown tables to benchmarks/results/.
# Run on an otherwise idle machine (check `uptime`): a concurrent job distorts every column.
set -euo pipefail
cd "$(dirname "$0")/.."
LATENTKV=${LATENTKV:-.venv/bin/latentkv}
THREADS=${THREADS:-2}
DECODE_TOKENS=${DECODE_TOKENS:-8}
OUT=benchmarks/results
mkdir -p "$OUT"

"$LATENTKV" bench decode builtin:slice --kv-cache-dtype f32,fp8,tq4 --fill random \
    --context 1024,4096,16384 --decode-tokens "$DECODE_TOKENS" --weight-dtype f32 \
    --threads "$THREADS" --out "$OUT/tiers-slice.json" | tee "$OUT/tiers-slice.md"
"$LATENTKV" bench attention --context 32768 --heads 64 --kv-lora 512 --rope 64 \
    --kv-cache-dtype f32,bf16,fp8,tq4,tq3,polar4 --repeats 5 \
    --threads "$THREADS" --out "$OUT/attention-32k.json" | tee "$OUT/attention-32k.md"
