#!/usr/bin/env bash
# Where a pipeline round trip goes: starts `baton coordinator` and STAGES `baton worker`s with
# Prometheus endpoints, drives them with `baton-bench load`, and prints per micro-batch the
# coordinator's round trip (`baton_step_seconds`), each stage's forward time
# (`baton_stage_forward_seconds`) and the time each stage's input took to arrive
# (`baton_transfer_seconds`: transport plus waiting for the stage to finish the micro-batch
# before it), from counters scraped before and after the load; the rest is the way back. Then
# each stage's busy share of the load's wall time: what a pipeline loses to waiting.
#
#   bench/round-trip.sh
#
#   CONCURRENCY=16 REQUESTS=32 MAX_TOKENS=128 WEIGHTS=q8_0 MAX_RUNNING=16 SPLIT=measured
#   STAGES=2         workers, each with 2/STAGES of this machine's 2 cores (1: the 1×2 baseline)
#   PORT=8490        HTTP on PORT, registry on PORT+1, worker i's metrics on PORT+5+i
#   BATON=PATH       the baton binary (default: target/release/baton)
#
# Needs a release build: cargo build --release --workspace.
set -euo pipefail

CONCURRENCY=${CONCURRENCY:-16}
REQUESTS=${REQUESTS:-32}
MAX_TOKENS=${MAX_TOKENS:-128}
WEIGHTS=${WEIGHTS:-q8_0}
MAX_RUNNING=${MAX_RUNNING:-16}
SPLIT=${SPLIT:-measured}
STAGES=${STAGES:-2}
[[ "$STAGES" == 1 || "$STAGES" == 2 ]] || { echo "round-trip: STAGES must be 1 or 2" >&2; exit 2; }
PORT=${PORT:-8490}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON=${BATON:-$REPO/target/release/baton}
BATON_BENCH="$REPO/target/release/baton-bench"
for b in "$BATON" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "round-trip: $b missing (cargo build --release --workspace)" >&2; exit 1; }
done
export BATON_CLUSTER_TOKEN=round-trip-token
LOGS=$(mktemp -d /tmp/round-trip.XXXXXX)

PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

"$BATON" coordinator --workers "$STAGES" --split "$SPLIT" --weights "$WEIGHTS" --max-running "$MAX_RUNNING" \
    --listen "127.0.0.1:$((PORT + 1))" --http "127.0.0.1:$PORT" >"$LOGS/coordinator.log" 2>&1 &
PIDS+=($!)
for i in $(seq 0 $((STAGES - 1))); do
    "$BATON" worker --device "cpu:$((2 / STAGES))" --coordinator "http://127.0.0.1:$((PORT + 1))" \
        --metrics-listen "127.0.0.1:$((PORT + 5 + i))" >"$LOGS/worker$i.log" 2>&1 &
    PIDS+=($!)
    sleep 1 # register in order: worker 0 is stage 0
done
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 0.2; done
curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null || { echo "round-trip: not ready; logs in $LOGS" >&2; exit 1; }
"$BATON_BENCH" load --url "http://127.0.0.1:$PORT" --concurrency 1 --requests 1 --max-tokens 8 >/dev/null 2>&1

snapshot() {
    for i in $(seq 0 $((STAGES - 1))); do
        curl -sf "http://127.0.0.1:$((PORT + 5 + i))/metrics" \
            | grep -E '^baton_(transfer_seconds|stage_forward_seconds)_(sum|count)'
    done
    curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E '^baton_step_seconds_(sum|count)'
}
snapshot >"$LOGS/before"
started=$(date +%s.%N)
"$BATON_BENCH" load --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
    --max-tokens "$MAX_TOKENS" 2>/dev/null | tail -2
ended=$(date +%s.%N)
snapshot >"$LOGS/after"
curl -sf "http://127.0.0.1:$PORT/admin/cluster" >"$LOGS/cluster.json"

python3 - "$LOGS" "$STAGES" "$started" "$ended" <<'EOF'
import json, sys
logs, stages = sys.argv[1], int(sys.argv[2])
wall = float(sys.argv[4]) - float(sys.argv[3])
def read(name):
    out = {}
    for line in open(f"{logs}/{name}"):
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out
before, after = read("before"), read("after")
d = {k: after[k] - before.get(k, 0.0) for k in after}
steps = d["baton_step_seconds_count"]
ms = lambda k: 1e3 * d[k] / steps
trip = ms("baton_step_seconds_sum")
parts = {}
for s in map(str, range(stages)):
    parts[f"stage {s} forward"] = ms(f'baton_stage_forward_seconds_sum{{stage="{s}"}}')
    parts[f"arrival at stage {s}"] = ms(f'baton_transfer_seconds_sum{{stage="{s}"}}')
view = json.load(open(f"{logs}/cluster.json"))
ranges = ", ".join(f"{s['layer_start']}..{s['layer_end']}" for s in view["stages"])
print(f"{int(steps)} micro-batches, layers {ranges}: round trip {trip:.1f} ms =")
for k, v in parts.items():
    print(f"  {k:20s} {v:6.1f} ms")
print(f"  {'the way back':20s} {trip - sum(parts.values()):6.1f} ms")
for s in map(str, range(stages)):
    busy = d[f'baton_stage_forward_seconds_sum{{stage="{s}"}}'] / wall
    print(f"stage {s} computed {100 * busy:.0f}% of the load's {wall:.1f} s")
EOF
