#!/usr/bin/env bash
# Live re-planning against the stuck plan: two `baton worker` processes pinned one per core
# serve a measured split planned on quiet cores; then a busy loop starts on worker SLOW's core
# (a noisy neighbour arriving mid-run: that worker gets about half a core). Each round starts a
# `baton coordinator` with `--live-replan true` and then `false` (interleaved), the same two
# workers fresh each time, starts the busy loop once the pipeline is ready, and drives it with
# `baton-bench load` twice: WARM requests while the coordinator notices and re-plans, then the
# measured load. It prints each policy's layer ranges before and after, the re-plan reason,
# output tok/s of the measured load, and live ÷ stuck.
#
#   bench/replan-ab.sh
#
#   ROUNDS=2 CONCURRENCY=16 REQUESTS=32 WARM=48 MAX_TOKENS=128 PROMPT_TOKENS=128   load
#   SLOW=1 WEIGHTS=q8_0 MAX_RUNNING=16 PORT=8491   how the pipeline runs (registry on PORT+1)
#   OUT=DIR          keep raw outputs and logs there (default: a new directory under /tmp)
#
# Needs 2 CPUs (taskset -c 0 and -c 1) and a release build: cargo build --release --workspace.
set -euo pipefail

ROUNDS=${ROUNDS:-2}
CONCURRENCY=${CONCURRENCY:-16}
REQUESTS=${REQUESTS:-32}
WARM=${WARM:-48}
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
SLOW=${SLOW:-1}
WEIGHTS=${WEIGHTS:-q8_0}
MAX_RUNNING=${MAX_RUNNING:-16}
PORT=${PORT:-8491}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON="$REPO/target/release/baton"
BATON_BENCH="$REPO/target/release/baton-bench"
OUT=${OUT:-$(mktemp -d /tmp/replan-ab.XXXXXX)}
mkdir -p "$OUT"
for b in "$BATON" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "replan-ab: $b missing (cargo build --release --workspace)" >&2; exit 1; }
done
command -v taskset >/dev/null || { echo "replan-ab: taskset not found (util-linux)" >&2; exit 1; }
[[ $(nproc) -ge 2 ]] || { echo "replan-ab: needs 2 CPUs" >&2; exit 1; }
export BATON_CLUSTER_TOKEN=replan-ab-token
URL="http://127.0.0.1:$PORT"

PIDS=()
stop_all() {
    # The busy loop runs in its own process group (setsid): kill the group.
    for p in "${PIDS[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
trap stop_all EXIT

registered() {
    curl -sf "$URL/admin/cluster" | python3 -c "import json,sys; sys.exit(len(json.load(sys.stdin)['workers']) < $1)" 2>/dev/null
}

run_policy() { # live round
    local live=$1 r=$2 tag="$1.$2"
    "$BATON" coordinator --log-level info --workers 2 --split measured --live-replan "$live" --weights "$WEIGHTS" \
        --max-running "$MAX_RUNNING" --listen "127.0.0.1:$((PORT + 1))" --http "127.0.0.1:$PORT" \
        >"$OUT/$tag.coordinator.log" 2>&1 &
    PIDS+=($!)
    for core in 0 1; do
        taskset -c "$core" "$BATON" worker --device cpu:1 --coordinator "http://127.0.0.1:$((PORT + 1))" \
            --worker-id "core$core" >"$OUT/$tag.worker$core.log" 2>&1 &
        PIDS+=($!)
        for _ in $(seq 300); do registered $((core + 1)) && break; sleep 0.2; done
    done
    for _ in $(seq 600); do curl -sf "$URL/ready" >/dev/null && break; sleep 0.2; done
    curl -sf "$URL/ready" >/dev/null || { echo "replan-ab: $tag not ready; logs in $OUT" >&2; exit 1; }
    curl -sf "$URL/admin/cluster" >"$OUT/$tag.before.json"
    # The neighbour arrives after the plan was made on quiet cores.
    setsid taskset -c "$SLOW" bash -c 'while :; do :; done' &
    PIDS+=($!)
    "$BATON_BENCH" load --url "$URL" --concurrency "$CONCURRENCY" --requests "$WARM" \
        --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --format json \
        >"$OUT/$tag.warm.json" 2>"$OUT/$tag.warm.log" || true
    for _ in $(seq 100); do curl -sf "$URL/ready" >/dev/null && break; sleep 0.2; done
    "$BATON_BENCH" load --url "$URL" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
        --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --format json \
        >"$OUT/$tag.json" 2>"$OUT/$tag.load.log" || true
    curl -sf "$URL/admin/cluster" >"$OUT/$tag.after.json"
    stop_all
}

echo "replan-ab: $ROUNDS rounds, concurrency $CONCURRENCY, busy loop on core $SLOW from the start of the load; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for live in true false; do
        run_policy "$live" "$r"
    done
done

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = {}
for live in ("true", "false"):
    tps = []
    for r in range(1, rounds + 1):
        lv = json.load(open(f"{out}/{live}.{r}.json"))["levels"][-1]
        ranges = lambda v: [f"{s['layer_start']}..{s['layer_end']}" for s in v["stages"]]
        before = json.load(open(f"{out}/{live}.{r}.before.json"))
        after = json.load(open(f"{out}/{live}.{r}.after.json"))
        tps.append(lv["output_tok_per_s"])
        print(f"live_replan={live:5s} round {r}: ranges {ranges(before)} -> {ranges(after)}, "
              f"re-plans {after['replans_total']}, out tok/s {lv['output_tok_per_s']:.1f}, "
              f"ITL p50 {lv['itl_s']['p50'] * 1e3:.1f} ms; {after['last_replan']}")
    med[live] = statistics.median(tps)
print(f"live / stuck, median out tok/s after the neighbour arrived: {med['true'] / med['false']:.2f}")
EOF
