#!/usr/bin/env bash
# Does the measured split pick the fastest cut? Serves one model through two worker processes
# (`baton coordinator` plus two `baton worker`s with THREADS threads each) once with the
# planner's split (`measured`) and once with each explicit cut in CUTS, interleaved round by
# round, and reports output tok/s for each. The measured run also saves /admin/cluster (the
# planner's layer ranges, predicted stage seconds and per-class milliseconds).
#
#   MODEL=DIR CUTS="6 7 8 9 10" bench/split-sweep.sh
#
#   ROUNDS=2 CONCURRENCY=8 REQUESTS=16 MAX_TOKENS=64 PROMPT_TOKENS=256   load (defaults)
#   THREADS=1 WEIGHTS=q8_0 PORT=8293 GRPC=50093                          how each server runs
#   OUT=DIR   keep raw outputs and logs there (default: a new directory under /tmp)
set -euo pipefail

MODEL=${MODEL:?MODEL=DIR or .gguf to serve}
CUTS=${CUTS:?CUTS=\"cut ...\" to compare with the measured split}
ROUNDS=${ROUNDS:-2}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-16}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_TOKENS=${PROMPT_TOKENS:-256}
THREADS=${THREADS:-1}
WEIGHTS=${WEIGHTS:-q8_0}
PORT=${PORT:-8293}
GRPC=${GRPC:-50093}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON="$REPO/target/release/baton"
BATON_BENCH="$REPO/target/release/baton-bench"
OUT=${OUT:-$(mktemp -d /tmp/split-sweep.XXXXXX)}
mkdir -p "$OUT"
for b in "$BATON" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "split-sweep: $b is not an executable (cargo build --release --workspace)" >&2; exit 1; }
done

# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"
WORKER_PIDS=()
stop_all() {
    stop
    for p in "${WORKER_PIDS[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
    WORKER_PIDS=()
}
trap stop_all EXIT
export BATON_CLUSTER_TOKEN=split-sweep

echo "split-sweep: $ROUNDS rounds of measured + cuts $CUTS; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for variant in measured $CUTS; do
        label="$variant.$r"
        cuts=()
        [[ $variant != measured ]] && cuts=(--layer-cuts "$variant")
        "$BATON" coordinator --model "$MODEL" --weights "$WEIGHTS" --workers 2 "${cuts[@]}" \
            --listen "127.0.0.1:$GRPC" --http "127.0.0.1:$PORT" >"$OUT/$label.coordinator.log" 2>&1 &
        PID=$!
        for w in 0 1; do
            "$BATON" worker --listen 127.0.0.1:0 --coordinator "http://127.0.0.1:$GRPC" \
                --device "cpu:$THREADS" >"$OUT/$label.worker$w.log" 2>&1 &
            WORKER_PIDS+=($!)
        done
        url="http://127.0.0.1:$PORT"
        wait_ready "$url" "$OUT/$label.coordinator.log" split-sweep
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests 1 --max-tokens 8 --format json >/dev/null 2>&1
        "$BATON_BENCH" load --url "$url" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
            --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" \
            --format json >"$OUT/$label.json" 2>"$OUT/$label.load.log" || true
        [[ $variant == measured ]] && curl -sf "$url/admin/cluster" >"$OUT/$label.cluster.json"
        stop_all
    done
done

python3 - "$OUT" "$ROUNDS" measured $CUTS <<'EOF'
import json, statistics, sys
out, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for v in variants:
    tps = []
    for r in range(1, rounds + 1):
        with open(f"{out}/{v}.{r}.json") as f:
            tps.append(json.load(f)["levels"][-1]["output_tok_per_s"])
    print(f"{v:>9}: out tok/s {[round(x, 1) for x in tps]} (median {statistics.median(tps):.1f})")
with open(f"{out}/measured.1.cluster.json") as f:
    split = json.load(f).get("split", {})
print("measured split:", json.dumps(split))
EOF
