#!/usr/bin/env bash
# Decode and prefill at 2 threads with and without a competing CPU-bound process on the machine,
# for Baton (`baton bench`) and llama.cpp (`llama-bench`): how much each loses when another
# process takes a core. Spinning worker threads (waiting for each other while the OS has
# descheduled one of them) collapse under contention; threads that park do not.
#
# The competitor is one busy-looping process per COMPETITORS (default 1), started before and
# killed after each "loaded" measurement. Runs alternate quiet / loaded and llama / Baton.
#
#   ROUNDS=2 THREADS=2 PROMPT=512 GEN=128 COMPETITORS=1   (defaults shown)
#   LLAMA_BUILD=/opt/llama.cpp-build LLAMA_MODELS=/opt/models   as in build.sh
set -euo pipefail

ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-512}
GEN=${GEN:-128}
COMPETITORS=${COMPETITORS:-1}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
LLAMA_MODELS=${LLAMA_MODELS:-/opt/models}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LLAMA_BENCH="$LLAMA_BUILD/bin/llama-bench"
BATON="$REPO/target/release/baton"
Q8="$LLAMA_MODELS/SmolLM2-135M-Instruct.Q8_0.gguf"

die() { echo "compare-contention: $*" >&2; exit 1; }
[[ -x "$LLAMA_BENCH" ]] || die "$LLAMA_BENCH missing: run bench/llamacpp/build.sh"
[[ -f "$Q8" ]] || die "$Q8 missing: run bench/llamacpp/build.sh"
[[ -x "$BATON" ]] || die "$BATON missing: cargo build --release"

PIDS=()
start_load() { for ((i = 0; i < COMPETITORS; i++)); do (while :; do :; done) & PIDS+=($!); done; }
stop_load() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; PIDS=(); }
trap stop_load EXIT

llama() { # -> "pp tg"
    "$LLAMA_BENCH" -m "$Q8" -p "$PROMPT" -n "$GEN" -t "$THREADS" -r 1 -o json 2>/dev/null \
        | python3 -c 'import json,sys; d={("pp" if e["n_gen"]==0 else "tg"):e["avg_ts"] for e in json.load(sys.stdin)}; print(d["pp"], d["tg"])'
}
baton() { # -> "pp tg"
    local pp tg
    pp=$("$BATON" bench prefill --weights q8_0 --threads "$THREADS" --tokens "$PROMPT" --reps 1 --format json 2>/dev/null \
        | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["prefill_tok_per_s"])')
    tg=$("$BATON" bench decode --weights q8_0 --threads "$THREADS" --tokens "$GEN" --reps 1 --format json 2>/dev/null \
        | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["decode_tok_per_s"])')
    echo "$pp $tg"
}

echo "| round | load | program | pp$PROMPT tok/s | tg$GEN tok/s |"
echo "|---|---|---|---|---|"
for ((r = 1; r <= ROUNDS; r++)); do
    for load in quiet loaded; do
        [[ $load == loaded ]] && start_load
        for prog in llama baton; do
            read -r pp tg < <("$prog")
            printf '| %d | %s | %s | %.1f | %.1f |\n' "$r" "$load" "$prog" "$pp" "$tg"
        done
        [[ $load == loaded ]] && stop_load
    done
done
