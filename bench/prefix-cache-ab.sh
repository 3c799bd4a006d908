#!/usr/bin/env bash
# Prefix caching off and on, interleaved (off on off on ...), on a workload whose prompts share
# a long head (a common system prompt) and differ in a short tail. Each round starts
# `baton serve` fresh, drives it with `baton-bench load --shared-prefix-tokens`, and reads the
# coordinator's prefix-cache counters from /metrics before stopping it.
#
#   bench/prefix-cache-ab.sh
#
#   ROUNDS=2 CONCURRENCY=4 REQUESTS=32 PROMPT_TOKENS=512 SHARED=448 MAX_TOKENS=32   load (defaults)
#   WORKERS=2 WEIGHTS=q8_0 PORT=8292   how each server runs
#   MODEL=DIR   serve this model instead of the embedded default (e.g. a hybrid from
#               bench/make_hybrid.py, whose prefix hits start from recurrent-state snapshots)
#   OUT=DIR   keep raw outputs and server logs there (default: a new directory under /tmp)
set -euo pipefail

ROUNDS=${ROUNDS:-2}
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-32}
PROMPT_TOKENS=${PROMPT_TOKENS:-512}
SHARED=${SHARED:-448}
MAX_TOKENS=${MAX_TOKENS:-32}
WORKERS=${WORKERS:-2}
WEIGHTS=${WEIGHTS:-q8_0}
PORT=${PORT:-8292}
MODEL=${MODEL:-}
MODEL_FLAGS=()
[[ -n "$MODEL" ]] && MODEL_FLAGS=(--model "$MODEL")
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON="$REPO/target/release/baton"
BATON_BENCH="$REPO/target/release/baton-bench"
OUT=${OUT:-$(mktemp -d /tmp/prefix-cache-ab.XXXXXX)}
mkdir -p "$OUT"
for b in "$BATON" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "prefix-cache-ab: $b is not an executable (cargo build --release --workspace)" >&2; exit 1; }
done

# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

echo "prefix-cache-ab: $ROUNDS rounds, concurrency $CONCURRENCY, prompts of $PROMPT_TOKENS words sharing $SHARED; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for caching in false true; do
        label=$([[ $caching == true ]] && echo on || echo off)
        "$BATON" serve "${MODEL_FLAGS[@]}" --weights "$WEIGHTS" --workers "$WORKERS" --host 127.0.0.1 --port "$PORT" \
            --prefix-caching "$caching" >"$OUT/$label.$r.server.log" 2>&1 &
        PID=$!
        wait_ready "http://127.0.0.1:$PORT" "$OUT/$label.$r.server.log" prefix-cache-ab
        url="http://127.0.0.1:$PORT"
        # Warm-up on an unrelated prompt: nothing of the measured prompts is cached before.
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests 1 --max-tokens 8 --format json >/dev/null 2>&1
        "$BATON_BENCH" load --url "$url" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
            --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --shared-prefix-tokens "$SHARED" \
            --temperature 0 --format json >"$OUT/$label.$r.json" 2>"$OUT/$label.$r.load.log" || true
        curl -sf "$url/metrics" | grep -E '^baton_prefix_cache_(hit|queried)_tokens_total' >"$OUT/$label.$r.metrics" || true
        stop
    done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
res = {}
for label in ("off", "on"):
    tps, ttft, e2e, hit = [], [], [], []
    for r in range(1, rounds + 1):
        with open(f"{out}/{label}.{r}.json") as f:
            lv = json.load(f)["levels"][-1]
        tps.append(lv["output_tok_per_s"])
        ttft.append(lv["ttft_s"]["p50"] * 1e3)
        e2e.append(lv["e2e_s"]["p50"] * 1e3)
        m = dict(l.split() for l in open(f"{out}/{label}.{r}.metrics") if l.strip())
        q = float(m.get("baton_prefix_cache_queried_tokens_total", 0))
        hit.append(float(m.get("baton_prefix_cache_hit_tokens_total", 0)) / q if q else 0.0)
    res[label] = (tps, ttft, e2e)
    print(f"{label:>3}: out tok/s {[round(x, 1) for x in tps]}, TTFT p50 ms {[round(x, 1) for x in ttft]}, "
          f"e2e p50 ms {[round(x, 1) for x in e2e]}, prompt tokens reused {[round(x, 3) for x in hit]}")
med = lambda label, i: statistics.median(res[label][i])
print(f"on / off: out tok/s {med('on', 0) / med('off', 0):.2f}, TTFT p50 {med('on', 1) / med('off', 1):.2f}, "
      f"e2e p50 {med('on', 2) / med('off', 2):.2f}")
PY
