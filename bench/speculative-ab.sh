#!/usr/bin/env bash
# Speculative decoding against plain decoding on one `baton` binary, interleaved: for each
# round, a server with `--speculative off` and one with `--speculative ngram` (each started
# fresh, in alternating order), each driven one request at a time (batch 1) through both
# workloads: editing and quoting prompts whose answers repeat the prompt
# (bench/data/speculative-repetitive.json) and open questions (speculative-open.json). Greedy,
# chat endpoint, EOS honoured. Reports each mode's median decode speed (1 / TPOT: output tokens
# after the first over the time after the first) per workload, and ngram ÷ off.
#
#   bench/speculative-ab.sh BATON
#
#   ROUNDS=3 MAX_TOKENS=192        rounds, and most tokens per answer
#   WORKERS=2 WEIGHTS=q8_0 K=4     how each server runs (K: --num-speculative-tokens)
#   PORT=8293 OUT=DIR              where it listens; keep raw outputs and logs in DIR
#   MODE=ngram                     the speculative mode set against off: ngram, or dflash
#   DRAFT=DIR                      the draft for MODE=dflash (bench/make_dflash_draft.py writes
#                                  a random-weight one: it measures the cost, not acceptance)
set -euo pipefail

[[ $# == 1 ]] || { echo "usage: $0 BATON" >&2; exit 2; }
BIN=$1
ROUNDS=${ROUNDS:-3}
MAX_TOKENS=${MAX_TOKENS:-192}
WORKERS=${WORKERS:-2}
WEIGHTS=${WEIGHTS:-q8_0}
K=${K:-4}
PORT=${PORT:-8293}
MODE=${MODE:-ngram}
DRAFT=${DRAFT:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON_BENCH=${BATON_BENCH:-$REPO/target/release/baton-bench}
OUT=${OUT:-$(mktemp -d /tmp/speculative-ab.XXXXXX)}
mkdir -p "$OUT"
for b in "$BIN" "$BATON_BENCH"; do
    [[ -x "$b" ]] || { echo "speculative-ab: $b is not an executable (cargo build --release --workspace)" >&2; exit 1; }
done

# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"

echo "speculative-ab: $ROUNDS rounds, $WORKERS workers, k = $K; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    modes=(off "$MODE")
    ((r % 2 == 0)) && modes=("$MODE" off)
    for mode in "${modes[@]}"; do
        draft=()
        [[ $mode == dflash ]] && draft=(--draft-model "$DRAFT")
        "$BIN" serve --weights "$WEIGHTS" --workers "$WORKERS" --host 127.0.0.1 --port "$PORT" \
            --speculative "$mode" --num-speculative-tokens "$K" "${draft[@]}" >"$OUT/$mode.$r.server.log" 2>&1 &
        PID=$!
        wait_ready "http://127.0.0.1:$PORT" "$OUT/$mode.$r.server.log" speculative-ab
        url="http://127.0.0.1:$PORT"
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests 1 --max-tokens 8 --format json >/dev/null 2>&1
        for w in repetitive open; do
            file="$REPO/bench/data/speculative-$w.json"
            n=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))))" "$file")
            "$BATON_BENCH" load --url "$url" --endpoint chat --concurrency 1 --requests "$n" \
                --prompt-file "$file" --max-tokens "$MAX_TOKENS" --ignore-eos false --temperature 0 \
                --format json >"$OUT/$mode.$w.$r.json" 2>"$OUT/$mode.$w.$r.load.log"
        done
        curl -s "$url/admin/cluster" >"$OUT/$mode.$r.cluster.json" || true
        stop
    done
done

python3 - "$OUT" "$ROUNDS" "$MODE" <<'EOF'
import json, statistics, sys
out, rounds, spec = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def level(path):
    with open(path) as f:
        return json.load(f)["levels"][-1]
for w in ("repetitive", "open"):
    med = {}
    for mode in ("off", spec):
        speed = [1 / level(f"{out}/{mode}.{w}.{r}.json")["tpot_s"]["mean"] for r in range(1, rounds + 1)]
        toks = [level(f"{out}/{mode}.{w}.{r}.json")["output_tokens"] for r in range(1, rounds + 1)]
        med[mode] = statistics.median(speed)
        print(f"{w:10s} {mode:5s}: decode tok/s {[round(x, 1) for x in speed]} (median {med[mode]:.1f}), output tokens {toks}")
    print(f"{w:10s} {spec} / off: {med[spec] / med['off']:.2f}")
for r in range(1, rounds + 1):
    try:
        s = json.load(open(f"{out}/{spec}.{r}.cluster.json"))["speculative"]
    except Exception:
        continue
    steps, prop, acc = s["verify_steps_total"], s["proposed_tokens_total"], s["accepted_tokens_total"]
    if steps:
        print(f"round {r} {spec}: {steps} verify steps, {prop} proposed, {acc} accepted "
              f"({acc / max(prop, 1):.0%}), {(acc + steps) / steps:.2f} tokens per verify step")
EOF
