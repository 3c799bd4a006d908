#!/usr/bin/env bash
# Two `baton` binaries serving the same load, interleaved (A B A B ...), to measure a change
# end to end: e.g. the binary of the previous commit against the current one. Each round starts
# the server fresh, sends one warm-up request, then drives it with `baton-bench load`
# (streaming /v1/completions, ignore_eos) and records aggregate output tok/s and ITL p50.
#
#   bench/serving-ab.sh OLD_BATON NEW_BATON
#
#   ROUNDS=2 CONCURRENCY=16 REQUESTS=32 MAX_TOKENS=128 PROMPT_TOKENS=128   load (defaults shown)
#   TEMPERATURE=1.0   sampling temperature sent with every request (0: greedy)
#   LOAD_ARGS=        more `baton-bench load` flags, e.g. "--ignore-eos false" with TEMPERATURE=0:
#                     greedy requests of different lengths, so prompts keep arriving while others
#                     decode (the same work every round) instead of in waves
#   WORKERS=1 WEIGHTS=q8_0 MAX_RUNNING=16 PORT=8291   how each server runs (MAX_RUNNING= empty:
#                     each binary's default); WORKERS="1 2" runs
#                     both worker counts in every round (1 × 2 threads, 2 × 1) and adds each
#                     binary's pipeline efficiency: out tok/s with the last count ÷ the first
#   OUT=DIR           keep raw outputs and server logs there (default: a new directory under /tmp)
set -euo pipefail

[[ $# == 2 ]] || { echo "usage: $0 OLD_BATON NEW_BATON" >&2; exit 2; }
BINS=("$1" "$2")
ROUNDS=${ROUNDS:-2}
CONCURRENCY=${CONCURRENCY:-16}
REQUESTS=${REQUESTS:-32}
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
TEMPERATURE=${TEMPERATURE:-1.0}
WORKERS=${WORKERS:-1}
WEIGHTS=${WEIGHTS:-q8_0}
MAX_RUNNING=${MAX_RUNNING-16}
read -r -a LOAD_EXTRA <<<"${LOAD_ARGS:-}"
PORT=${PORT:-8291}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON_BENCH="$REPO/target/release/baton-bench"
OUT=${OUT:-$(mktemp -d /tmp/serving-ab.XXXXXX)}
mkdir -p "$OUT"
for b in "${BINS[@]}" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "serving-ab: $b is not an executable (cargo build --release --workspace)" >&2; exit 1; }
done

# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

echo "serving-ab: $ROUNDS rounds, concurrency $CONCURRENCY, temperature $TEMPERATURE; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for w in $WORKERS; do for i in 0 1; do
        label=$([[ $i == 0 ]] && echo A || echo B)$w
        running=()
        [[ -n "$MAX_RUNNING" ]] && running=(--max-running "$MAX_RUNNING")
        "${BINS[$i]}" serve --weights "$WEIGHTS" --workers "$w" --host 127.0.0.1 --port "$PORT" \
            "${running[@]}" >"$OUT/$label.$r.server.log" 2>&1 &
        PID=$!
        wait_ready "http://127.0.0.1:$PORT" "$OUT/$label.$r.server.log" serving-ab
        url="http://127.0.0.1:$PORT"
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests 1 --max-tokens 8 \
            --temperature "$TEMPERATURE" --format json >/dev/null 2>&1
        "$BATON_BENCH" load --url "$url" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
            --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --temperature "$TEMPERATURE" \
            "${LOAD_EXTRA[@]}" --format json >"$OUT/$label.$r.json" 2>"$OUT/$label.$r.load.log" || true
        stop
    done; done
done

python3 - "$OUT" "$ROUNDS" $WORKERS <<'EOF'
import json, statistics, sys
out, rounds, workers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def level(path):
    with open(path) as f:
        return json.load(f)["levels"][-1]
res = {}
for w in workers:
    for label in ("A" + w, "B" + w):
        tps, itl = [], []
        for r in range(1, rounds + 1):
            lv = level(f"{out}/{label}.{r}.json")
            tps.append(lv["output_tok_per_s"])
            itl.append(lv["itl_s"]["p50"] * 1e3)
        res[label] = (tps, itl)
        print(f"{label} ({w} workers): out tok/s {[round(x, 1) for x in tps]} "
              f"(median {statistics.median(tps):.1f}), ITL p50 ms {[round(x, 1) for x in itl]}")
    ratio = statistics.median(res["B" + w][0]) / statistics.median(res["A" + w][0])
    print(f"B / A with {w} workers, median out tok/s: {ratio:.2f}")
if len(workers) > 1:
    lo, hi = workers[0], workers[-1]
    for b in "AB":
        per_round = [h / l for h, l in zip(res[b + hi][0], res[b + lo][0])]
        print(f"{b}: {hi} workers / {lo} per round {[round(x, 2) for x in per_round]}, "
              f"median {statistics.median(per_round):.2f}")
EOF
