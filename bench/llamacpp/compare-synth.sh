#!/usr/bin/env bash
# Batch-1 decode and prefill of llama.cpp's llama-bench and `baton bench` on one synthetic GGUF
# (`baton-bench synth`: random Q8_0 weights of a released model's shape, e.g. Qwen3-30B-A3B's
# layers), side by side: the same file, Q8_0 blocks as stored in both (Baton `--weights native`),
# the same threads. Rounds interleave, alternating which program goes first; prints each
# round's tok/s and the medians' ratio.
#
#   MODEL=/opt/synth/qwen3-30b-a3b-8l.gguf   the file (make it with baton-bench synth)
#   ROUNDS=3 THREADS=2 PROMPT=512 GEN=64      what to measure (defaults shown)
#   LLAMA_BUILD=/opt/llama.cpp-build          as in build.sh
#   BATON=target/release/baton                the Baton binary
#   OUT=DIR                                   keep the raw outputs there (default: under /tmp)
#
# Differences that remain: llama-bench's tg starts from an empty context after a warm-up run;
# `baton bench decode` is an 8-token prompt then GEN greedy tokens, timed together.
set -euo pipefail

MODEL=${MODEL:?set MODEL to a GGUF made by baton-bench synth}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
PROMPT=${PROMPT:-512}
GEN=${GEN:-64}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BATON=${BATON:-$REPO/target/release/baton}
LLAMA_BENCH="$LLAMA_BUILD/bin/llama-bench"
die() { echo "compare-synth: $*" >&2; exit 1; }
[[ -x "$LLAMA_BENCH" ]] || die "$LLAMA_BENCH missing: run bench/llamacpp/build.sh"
[[ -x "$BATON" ]] || die "$BATON missing: cargo build --release -p baton-coordinator"
[[ -f "$MODEL" ]] || die "$MODEL missing: make it with baton-bench synth"
OUT=${OUT:-$(mktemp -d /tmp/compare-synth.XXXXXX)}
mkdir -p "$OUT"

llama() { # round kind
    local args=(-p 0 -n "$GEN")
    [[ $2 == prefill ]] && args=(-p "$PROMPT" -n 0)
    "$LLAMA_BENCH" -m "$MODEL" "${args[@]}" -t "$THREADS" -r 1 -o json >"$OUT/llama-$2-r$1.json" 2>"$OUT/llama-$2-r$1.log" \
        || die "llama-bench failed: $(tail -3 "$OUT/llama-$2-r$1.log")"
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["avg_ts"])' "$OUT/llama-$2-r$1.json"
}
baton() { # round kind
    local tokens=$GEN
    [[ $2 == prefill ]] && tokens=$PROMPT
    "$BATON" bench "$2" --model "$MODEL" --weights native --threads "$THREADS" --tokens "$tokens" --reps 1 \
        --format json >"$OUT/baton-$2-r$1.json" 2>"$OUT/baton-$2-r$1.log" \
        || die "baton bench failed: $(tail -3 "$OUT/baton-$2-r$1.log")"
    python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.strip()][-1]; print(r[sys.argv[2] + "_tok_per_s"])' "$OUT/baton-$2-r$1.json" "$2"
}

echo "compare-synth: $MODEL, $ROUNDS rounds, $THREADS threads; raw outputs in $OUT" >&2
for kind in decode prefill; do
    l=() b=()
    for ((r = 1; r <= ROUNDS; r++)); do
        if ((r % 2)); then l+=("$(llama "$r" "$kind")"); b+=("$(baton "$r" "$kind")")
        else b+=("$(baton "$r" "$kind")"); l+=("$(llama "$r" "$kind")"); fi
        echo "compare-synth: $kind round $r: llama.cpp ${l[-1]} tok/s, Baton ${b[-1]} tok/s" >&2
    done
    python3 - "$kind" "${l[*]}" "${b[*]}" <<'PY'
import statistics, sys
kind, l, b = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
ml, mb = statistics.median(l), statistics.median(b)
print(f"{kind}: llama.cpp {ml:.2f} tok/s [{min(l):.2f}-{max(l):.2f}], Baton {mb:.2f} tok/s [{min(b):.2f}-{max(b):.2f}], Baton / llama.cpp {mb / ml:.2f}")
PY
done
