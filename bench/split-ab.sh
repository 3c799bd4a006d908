#!/usr/bin/env bash
# The split planner against the even split, on a pipeline whose workers are not alike: two
# `baton worker` processes pinned one per core, where the core of worker SLOW also runs a busy
# loop (a noisy neighbour: that worker gets about half a core). Each round starts a
# `baton coordinator` with `--split even` and then with `--split measured` (interleaved), the
# same two workers fresh each time, and drives it with `baton-bench load` (streaming
# /v1/completions, ignore_eos). It prints each policy's layer ranges, predicted stage times,
# aggregate output tok/s and ITL p50, and measured ÷ even.
#
#   bench/split-ab.sh
#
#   ROUNDS=2 CONCURRENCY=16 REQUESTS=32 MAX_TOKENS=128 PROMPT_TOKENS=128   load (defaults shown)
#   SLOW=1           which worker (stage) shares its core with the busy loop; NONE: neither
#   WEIGHTS=q8_0 MAX_RUNNING=16 PORT=8391   how the pipeline runs (registry on PORT+1)
#   OUT=DIR          keep raw outputs and logs there (default: a new directory under /tmp)
#
# Needs 2 CPUs (taskset -c 0 and -c 1) and a release build: cargo build --release --workspace.
set -euo pipefail

ROUNDS=${ROUNDS:-2}
CONCURRENCY=${CONCURRENCY:-16}
REQUESTS=${REQUESTS:-32}
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
SLOW=${SLOW:-1}
WEIGHTS=${WEIGHTS:-q8_0}
MAX_RUNNING=${MAX_RUNNING:-16}
PORT=${PORT:-8391}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON="$REPO/target/release/baton"
BATON_BENCH="$REPO/target/release/baton-bench"
OUT=${OUT:-$(mktemp -d /tmp/split-ab.XXXXXX)}
mkdir -p "$OUT"
for b in "$BATON" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "split-ab: $b missing (cargo build --release --workspace)" >&2; exit 1; }
done
command -v taskset >/dev/null || { echo "split-ab: taskset not found (util-linux)" >&2; exit 1; }
[[ $(nproc) -ge 2 ]] || { echo "split-ab: needs 2 CPUs" >&2; exit 1; }
export BATON_CLUSTER_TOKEN=split-ab-token
URL="http://127.0.0.1:$PORT"

PIDS=()
stop_all() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
trap stop_all EXIT

# `registered N`: true once N workers are listed by the coordinator.
registered() {
    curl -sf "$URL/admin/cluster" | python3 -c "import json,sys; sys.exit(len(json.load(sys.stdin)['workers']) < $1)" 2>/dev/null
}

run_policy() { # policy round
    local policy=$1 r=$2 tag="$1.$2"
    if [[ "$SLOW" != NONE ]]; then
        taskset -c "$SLOW" bash -c 'while :; do :; done' &
        PIDS+=($!)
    fi
    "$BATON" coordinator --log-level info --workers 2 --split "$policy" --weights "$WEIGHTS" --max-running "$MAX_RUNNING" \
        --listen "127.0.0.1:$((PORT + 1))" --http "127.0.0.1:$PORT" >"$OUT/$tag.coordinator.log" 2>&1 &
    PIDS+=($!)
    for core in 0 1; do
        taskset -c "$core" "$BATON" worker --device cpu:1 --coordinator "http://127.0.0.1:$((PORT + 1))" \
            --worker-id "core$core" >"$OUT/$tag.worker$core.log" 2>&1 &
        PIDS+=($!)
        # Register in core order, so worker `core0` is stage 0.
        for _ in $(seq 300); do registered $((core + 1)) && break; sleep 0.2; done
    done
    for _ in $(seq 600); do curl -sf "$URL/ready" >/dev/null && break; sleep 0.2; done
    curl -sf "$URL/ready" >/dev/null || { echo "split-ab: $tag not ready; logs in $OUT" >&2; exit 1; }
    "$BATON_BENCH" load --url "$URL" --concurrency 1 --requests 1 --max-tokens 8 --format json >/dev/null 2>&1
    "$BATON_BENCH" load --url "$URL" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
        --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --format json \
        >"$OUT/$tag.json" 2>"$OUT/$tag.load.log" || true
    # Stage timings are polled while someone looks: look, wait for the poll, then keep the view.
    curl -sf "$URL/admin/cluster" >/dev/null
    sleep 1.5
    curl -sf "$URL/admin/cluster" >"$OUT/$tag.cluster.json"
    stop_all
}

echo "split-ab: $ROUNDS rounds, concurrency $CONCURRENCY, busy loop on core $SLOW; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for policy in even measured; do
        run_policy "$policy" "$r"
    done
done

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = {}
for policy in ("even", "measured"):
    tps = []
    for r in range(1, rounds + 1):
        lv = json.load(open(f"{out}/{policy}.{r}.json"))["levels"][-1]
        view = json.load(open(f"{out}/{policy}.{r}.cluster.json"))
        ranges = [f"{s['layer_start']}..{s['layer_end']}" for s in view["stages"]]
        pred = [round(s["predicted_ms"], 1) if s.get("predicted_ms") else None for s in view["stages"]]
        live = [s["live"] for s in view["stages"]]
        meas = [round(1e3 * l["forward_seconds"] / l["forward_batches"], 1) if l and l["forward_batches"] else None for l in live]
        tps.append(lv["output_tok_per_s"])
        print(f"{policy:8s} round {r}: ranges {ranges}, predicted ms {pred}, measured ms/batch {meas}, "
              f"out tok/s {lv['output_tok_per_s']:.1f}, ITL p50 {lv['itl_s']['p50'] * 1e3:.1f} ms")
    med[policy] = statistics.median(tps)
print(f"measured / even, median out tok/s: {med['measured'] / med['even']:.2f}")
EOF
