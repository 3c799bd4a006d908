#!/usr/bin/env bash
# Serving under concurrent streaming load, llama.cpp's llama-server against `baton serve`, same
# model and weight precision (Q8_0), same 2 cores, driven by the same load generator
# (`baton-bench load`, streaming /v1/completions with ignore_eos, so every request produces
# exactly MAX_TOKENS tokens). Servers run one at a time, in this order:
#
#   llama-server  llama-server -t 2 -np NP (NP slots decoded as one batch)
#   baton-1x2     baton serve --weights q8_0 --workers 1   (1 stage × 2 threads)
#   baton-2x1     baton serve --weights q8_0 --workers 2   (2 stages × 1 thread; `baton serve`
#                 splits the machine's cores among its workers)
#
# and prints per server and concurrency: aggregate out tok/s, TTFT and ITL p50/p99, TPOT and
# E2E p50; then Baton(1×2) ÷ llama-server and Baton(2×1) ÷ Baton(1×2) at the highest
# concurrency, and each server's batching gain (aggregate at the highest ÷ at the lowest).
#
# Run on a quiet machine. llama.cpp is built outside the repo by bench/llamacpp/build.sh.
#
#   CONCURRENCY=1,4,16 REQUESTS=2,8,32 MAX_TOKENS=128 PROMPT_TOKENS=128   load (defaults shown)
#   SERVERS="llama-server baton-1x2 baton-2x1"   which servers, in order
#   NP=16            llama-server slots (default: the highest concurrency)
#   SLOT_CTX=512     llama-server context per slot (default: max(512, 2×PROMPT_TOKENS+MAX_TOKENS+64));
#                    -c is NP × SLOT_CTX
#   BATON_MAX_RUNNING=16   baton serve --max-running (default: NP, so both run as many sequences at
#                    once; Baton's own default is 8)
#   PORT=8191        llama-server listens on PORT, baton-1x2 on PORT+1, baton-2x1 on PORT+2
#   WARMUP=1         one 8-token request before each server's measurement (0: none)
#   LLAMA_BUILD=/opt/llama.cpp-build LLAMA_MODELS=/opt/models   as in build.sh
#   MODEL=FILE.gguf  another Q8_0 GGUF both servers load (e.g. from convert-synth.sh;
#                    default: the Q8_0 SmolLM2 file build.sh makes)
#   OUT=DIR          keep raw outputs and server logs there (default: a new directory under /tmp)
set -euo pipefail

CONCURRENCY=${CONCURRENCY:-1,4,16}
REQUESTS=${REQUESTS:-2,8,32}
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
SERVERS=${SERVERS:-llama-server baton-1x2 baton-2x1}
HI=$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)
NP=${NP:-$HI}
SLOT_CTX=${SLOT_CTX:-$((2 * PROMPT_TOKENS + MAX_TOKENS + 64 > 512 ? 2 * PROMPT_TOKENS + MAX_TOKENS + 64 : 512))}
BATON_MAX_RUNNING=${BATON_MAX_RUNNING:-$NP}
PORT=${PORT:-8191}
WARMUP=${WARMUP:-1}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
LLAMA_MODELS=${LLAMA_MODELS:-/opt/models}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$REPO/bench/llamacpp"
LLAMA_SERVER="$LLAMA_BUILD/bin/llama-server"
BATON="$REPO/target/release/baton"
BATON_BENCH="$REPO/target/release/baton-bench"
Q8=${MODEL:-$LLAMA_MODELS/SmolLM2-135M-Instruct.Q8_0.gguf}

die() { echo "compare-serving: $*" >&2; exit 1; }
if [[ " $SERVERS " == *" llama-server "* ]]; then
    [[ -x "$LLAMA_SERVER" ]] || die "$LLAMA_SERVER missing: run bench/llamacpp/build.sh (or set LLAMA_BUILD)"
    [[ -f "$Q8" ]] || die "$Q8 missing: run bench/llamacpp/build.sh (or set LLAMA_MODELS)"
fi
for b in "$BATON" "$BATON_BENCH"; do
    [[ -x "$b" ]] || die "$b missing: cargo build --release -p baton-coordinator -p baton-bench"
done
command -v curl >/dev/null || die "curl not found"
command -v python3 >/dev/null || die "python3 not found"

OUT=${OUT:-$(mktemp -d /tmp/llamacpp-serving.XXXXXX)}
mkdir -p "$OUT"
: >"$OUT/servers.txt"

# Every server runs in its own session (setsid), so stopping it stops its children (Baton's
# worker processes) and nothing else.
SERVER_PID=""
stop_server() {
    [[ -n "$SERVER_PID" ]] || return 0
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 -- "-$SERVER_PID" 2>/dev/null || break
        sleep 0.2
    done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

start_server() { # label port health-path command...
    local label=$1 port=$2 health=$3
    shift 3
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
        die "port $port is already in use (set PORT)"
    fi
    echo "compare-serving: starting $label: $*" >&2
    setsid "$@" >"$OUT/$label.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 600); do
        kill -0 "$SERVER_PID" 2>/dev/null || die "$label exited while starting: $(tail -5 "$OUT/$label.log")"
        if [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port$health")" == 200 ]]; then
            return 0
        fi
        sleep 0.5
    done
    die "$label not ready after 300 s (log: $OUT/$label.log)"
}

measure() { # label port
    local url="http://127.0.0.1:$2"
    if [[ "$WARMUP" == 1 ]]; then
        "$BATON_BENCH" load --url "$url" --concurrency 1 --requests 1 --max-tokens 8 \
            --prompt-tokens "$PROMPT_TOKENS" --format json >"$OUT/$1.warmup.json" 2>&1 \
            || die "$1: warm-up request failed: $(tail -3 "$OUT/$1.warmup.json")"
    fi
    echo "compare-serving: measuring $1 (concurrency $CONCURRENCY, requests $REQUESTS)" >&2
    # Exit status 1 only means some request failed; the report says which, so go on.
    "$BATON_BENCH" load --url "$url" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
        --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --format json \
        >"$OUT/$1.json" 2>"$OUT/$1.load.log" \
        || echo "compare-serving: $1: $(tail -1 "$OUT/$1.load.log")" >&2
}

echo "compare-serving: raw outputs and server logs in $OUT; load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for s in $SERVERS; do
    case "$s" in
    llama-server)
        port=$PORT
        echo -e "llama-server\tllama-server -t 2 -np $NP" >>"$OUT/servers.txt"
        start_server "$s" "$port" /health "$LLAMA_SERVER" -m "$Q8" --host 127.0.0.1 --port "$port" \
            -t 2 -np "$NP" -c $((NP * SLOT_CTX))
        ;;
    baton-1x2 | baton-2x1)
        if [[ "$s" == baton-1x2 ]]; then workers=1 port=$((PORT + 1)); else workers=2 port=$((PORT + 2)); fi
        echo -e "$s\tBaton $([[ $workers == 1 ]] && echo '1×2' || echo '2×1') (--workers $workers)" >>"$OUT/servers.txt"
        start_server "$s" "$port" /ready "$BATON" serve --model "$Q8" --weights q8_0 --workers "$workers" \
            --host 127.0.0.1 --port "$port" --max-running "$BATON_MAX_RUNNING"
        ;;
    *) die "unknown server $s (llama-server, baton-1x2, baton-2x1)" ;;
    esac
    measure "$s" "$port"
    stop_server
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

echo "## Serving: llama-server vs baton serve, Q8_0, $PROMPT_TOKENS-token prompts, $MAX_TOKENS tokens per request ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load after: $LOAD_AFTER)"
echo
echo "Concurrency $CONCURRENCY with requests $REQUESTS; llama-server -c $((NP * SLOT_CTX)) ($SLOT_CTX per slot); baton serve --max-running $BATON_MAX_RUNNING."
echo
python3 "$HERE/table.py" serving "$OUT"
