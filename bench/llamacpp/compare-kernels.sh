#!/usr/bin/env bash
# Prefill (pp) and batch-1 decode (tg) of llama.cpp's llama-bench and Baton's
# `baton-bench reference`, side by side: same model (SmolLM2-135M-Instruct), same weight precision
# (Q8_0: the GGUF re-quantized by build.sh from the Q4_1 file, and Baton's `--weights q8_0`, which
# re-quantizes the same Q4_1 weights at load), same thread count. Runs interleave round by round
# and thread count by thread count, alternating which program goes first; the table gives medians,
# [min–max] over rounds and Baton / llama.cpp (ratio of the medians).
#
# Run on a quiet machine (nothing else on the cores: llama.cpp's spinning threads collapse under
# contention). llama.cpp is built outside the repo by bench/llamacpp/build.sh.
#
#   ROUNDS=3 THREADS=1,2 PROMPT=512 GEN=128   what to measure (defaults shown)
#   FORMAT=q8_0  or q4_1: llama.cpp on the original Q4_1 file against Baton's `--weights native`
#                (the same Q4_1 blocks as stored, Q8_0 tied head/embedding in both)
#   LLAMA_BUILD=/opt/llama.cpp-build LLAMA_MODELS=/opt/models   as in build.sh
#   OUT=DIR      keep the raw outputs there (default: a new directory under /tmp, printed)
#
# Differences that remain: llama-bench's tg starts from an empty context after one warm-up run;
# Baton's decode is an 8-token prompt then GEN greedy tokens, timed together, no warm-up.
# Each `baton-bench reference` call also runs its fp32-reference configuration (ignored here).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1,2}
PROMPT=${PROMPT:-512}
GEN=${GEN:-128}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
LLAMA_MODELS=${LLAMA_MODELS:-/opt/models}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$REPO/bench/llamacpp"
LLAMA_BENCH="$LLAMA_BUILD/bin/llama-bench"
BATON_BENCH="$REPO/target/release/baton-bench"
FORMAT=${FORMAT:-q8_0}
BATON_HOME=${BATON_HOME:-$HOME/.cache/baton}
case "$FORMAT" in
    q8_0) Q8="$LLAMA_MODELS/SmolLM2-135M-Instruct.Q8_0.gguf"; BATON_WEIGHTS=q8_0 ;;
    q4_1) Q8="$BATON_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"; BATON_WEIGHTS=native ;;
    *) echo "compare-kernels: FORMAT must be q8_0 or q4_1, got $FORMAT" >&2; exit 1 ;;
esac

die() { echo "compare-kernels: $*" >&2; exit 1; }
[[ -x "$LLAMA_BENCH" ]] || die "$LLAMA_BENCH missing: run bench/llamacpp/build.sh (or set LLAMA_BUILD)"
[[ -f "$Q8" ]] || die "$Q8 missing: run bench/llamacpp/build.sh (or set LLAMA_MODELS)"
[[ -x "$BATON_BENCH" ]] || die "$BATON_BENCH missing: cargo build --release -p baton-bench"
command -v python3 >/dev/null || die "python3 not found"

OUT=${OUT:-$(mktemp -d /tmp/llamacpp-kernels.XXXXXX)}
mkdir -p "$OUT"
IFS=, read -r -a TS <<<"$THREADS"

run_llama() { # round threads
    "$LLAMA_BENCH" -m "$Q8" -p "$PROMPT" -n "$GEN" -t "$2" -r 1 -o json \
        >"$OUT/llama-r$1-t$2.json" 2>"$OUT/llama-r$1-t$2.log" \
        || die "llama-bench failed (exit $?): $(tail -3 "$OUT/llama-r$1-t$2.log")"
}
run_baton() { # round threads
    "$BATON_BENCH" reference --weights "$BATON_WEIGHTS" --threads "$2" --prompt-tokens "$PROMPT" \
        --gen-tokens "$GEN" --reps 1 >"$OUT/baton-r$1-t$2.jsonl" 2>"$OUT/baton-r$1-t$2.log" \
        || die "baton-bench reference failed (exit $?): $(tail -3 "$OUT/baton-r$1-t$2.log")"
}

echo "compare-kernels: $ROUNDS rounds, threads $THREADS, pp$PROMPT / tg$GEN; raw outputs in $OUT" >&2
echo "compare-kernels: load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
n=0
for ((r = 1; r <= ROUNDS; r++)); do
    for t in "${TS[@]}"; do
        if ((n++ % 2 == 0)); then first=llama second=baton; else first=baton second=llama; fi
        echo "compare-kernels: round $r, $t thread(s): $first, then $second" >&2
        "run_$first" "$r" "$t"
        "run_$second" "$r" "$t"
    done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

echo "## llama.cpp vs Baton, $FORMAT (Baton --weights $BATON_WEIGHTS), pp$PROMPT / tg$GEN, $ROUNDS rounds ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load after: $LOAD_AFTER)"
echo
BATON_WEIGHTS=$BATON_WEIGHTS python3 "$HERE/table.py" kernels "$OUT"
