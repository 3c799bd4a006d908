#!/usr/bin/env bash
# Cold time to first token of a long prompt through Baton (one worker × 2 threads and two
# workers × 1 thread, via bench/ttft-ab.sh: `baton serve`, HTTP, a different prompt per request,
# prefix caching off) against llama.cpp's prefill of the same number of tokens (llama-bench
# `-p N -n 0 -t 2`, Q8_0 re-quantized from the same Q4_1 file by build.sh), interleaved round by
# round. llama-bench times the prefill alone; Baton's TTFT also holds tokenizing, HTTP and the
# first sampled token, so the comparison is conservative for Baton.
#
#   bench/llamacpp/compare-prefill.sh BATON
#
#   ROUNDS=3 PROMPT_TOKENS=1060 REQUESTS=4   (defaults shown)
#   LLAMA_BUILD=/opt/llama.cpp-build LLAMA_MODELS=/opt/models   as in build.sh
#   OUT=DIR      keep the raw outputs there (default: a new directory under /tmp, printed)
set -euo pipefail

[[ $# == 1 ]] || { echo "usage: $0 BATON" >&2; exit 2; }
BATON=$1
ROUNDS=${ROUNDS:-3}
PROMPT_TOKENS=${PROMPT_TOKENS:-1060}
REQUESTS=${REQUESTS:-4}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
LLAMA_MODELS=${LLAMA_MODELS:-/opt/models}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d /tmp/compare-prefill.XXXXXX)}
mkdir -p "$OUT"
LLAMA_BENCH="$LLAMA_BUILD/bin/llama-bench"
Q8="$LLAMA_MODELS/SmolLM2-135M-Instruct.Q8_0.gguf"
for f in "$LLAMA_BENCH" "$BATON"; do
    [[ -x "$f" ]] || { echo "compare-prefill: $f missing (bench/llamacpp/build.sh, cargo build --release)" >&2; exit 1; }
done

echo "compare-prefill: $ROUNDS rounds, $PROMPT_TOKENS-token prompts; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    "$LLAMA_BENCH" -m "$Q8" -p "$PROMPT_TOKENS" -n 0 -t 2 -r 3 -o json >"$OUT/llama.$r.json" 2>/dev/null
    OUT="$OUT/baton.$r" ROUNDS=1 REQUESTS="$REQUESTS" PROMPT_TOKENS="$PROMPT_TOKENS" \
        "$REPO/bench/ttft-ab.sh" "$BATON" >"$OUT/baton.$r.txt" 2>&1
done

python3 - "$OUT" "$ROUNDS" "$PROMPT_TOKENS" <<'PY'
import json, statistics, sys
out, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llama, baton = [], {"1": [], "2": []}
for r in range(1, rounds + 1):
    rows = json.load(open(f"{out}/llama.{r}.json"))
    llama.append(n / rows[0]["avg_ts"] * 1e3)
    for w in baton:
        lv = json.load(open(f"{out}/baton.{r}/b0.w{w}.1.json"))["levels"][-1]
        baton[w].append(lv["ttft_s"]["p50"] * 1e3)
ml = statistics.median(llama)
print(f"llama.cpp prefill of {n} tokens, 2 threads: ms per round {[round(x) for x in llama]}, median {ml:.0f}")
for w, label in (("1", "1 worker x 2 threads"), ("2", "2 workers x 1 thread")):
    m = statistics.median(baton[w])
    print(f"Baton TTFT {label}: ms per round {[round(x) for x in baton[w]]}, median {m:.0f}, / llama.cpp {m / ml:.2f}")
m1, m2 = statistics.median(baton["1"]), statistics.median(baton["2"])
print(f"Baton 2 x 1 / 1 x 2: {m2 / m1:.2f}")
PY
