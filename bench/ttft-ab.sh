#!/usr/bin/env bash
# Cold time to first token of a long prompt: one worker with every thread against a pipeline of
# one-thread workers, for one or two `baton` binaries, interleaved (for each round: each binary,
# each worker count), each server started fresh. Every request has a different prompt, so no
# prefix-cache block helps; prefix caching is also turned off. Reports the median TTFT of each
# (binary, workers) and, per binary, TTFT with the last worker count ÷ the first.
#
#   bench/ttft-ab.sh BATON [BATON2]
#
#   ROUNDS=3 REQUESTS=4 PROMPT_TOKENS=1060   requests per server (one at a time) and prompt size
#   WORKERS="1 2" WEIGHTS=q8_0 PORT=8292     how each server runs
#   EXTRA="--max-batch-tokens 256"           more `baton serve` flags for every server
#   OUT=DIR                                  keep raw outputs and server logs there
set -euo pipefail

[[ $# == 1 || $# == 2 ]] || { echo "usage: $0 BATON [BATON2]" >&2; exit 2; }
BINS=("$@")
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-4}
PROMPT_TOKENS=${PROMPT_TOKENS:-1060}
WORKERS=${WORKERS:-1 2}
WEIGHTS=${WEIGHTS:-q8_0}
PORT=${PORT:-8292}
EXTRA=${EXTRA:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON_BENCH=${BATON_BENCH:-$REPO/target/release/baton-bench}
OUT=${OUT:-$(mktemp -d /tmp/ttft-ab.XXXXXX)}
mkdir -p "$OUT"
for b in "${BINS[@]}" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "ttft-ab: $b is not an executable (cargo build --release --workspace)" >&2; exit 1; }
done

# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

echo "ttft-ab: $ROUNDS rounds of $REQUESTS requests of ~$PROMPT_TOKENS prompt tokens; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for i in "${!BINS[@]}"; do for w in $WORKERS; do
        label="b$i.w$w"
        # shellcheck disable=SC2086
        "${BINS[$i]}" serve --weights "$WEIGHTS" --workers "$w" --host 127.0.0.1 --port "$PORT" \
            --prefix-caching false $EXTRA >"$OUT/$label.$r.server.log" 2>&1 &
        PID=$!
        wait_ready "http://127.0.0.1:$PORT" "$OUT/$label.$r.server.log" ttft-ab
        url="http://127.0.0.1:$PORT"
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests 1 --max-tokens 2 \
            --prompt-tokens 64 --format json >/dev/null 2>&1
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests "$REQUESTS" --max-tokens 2 \
            --prompt-tokens "$PROMPT_TOKENS" --format json >"$OUT/$label.$r.json" 2>"$OUT/$label.$r.load.log" || true
        stop
    done; done
done

python3 - "$OUT" "$ROUNDS" "${#BINS[@]}" $WORKERS <<'PY'
import json, statistics, sys
out, rounds, nbins, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
med = {}
for i in range(nbins):
    for w in workers:
        ttft = []
        for r in range(1, rounds + 1):
            lv = json.load(open(f"{out}/b{i}.w{w}.{r}.json"))["levels"][-1]
            ttft.append(lv["ttft_s"]["p50"] * 1e3)
        med[(i, w)] = statistics.median(ttft)
        print(f"binary {i}, {w} workers: TTFT p50 per round ms {[round(x) for x in ttft]}, median {med[(i, w)]:.0f}")
    if len(workers) > 1:
        lo, hi = workers[0], workers[-1]
        print(f"binary {i}: TTFT {hi} workers / {lo} workers = {med[(i, hi)] / med[(i, lo)]:.2f}")
PY
