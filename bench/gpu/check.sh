#!/usr/bin/env bash
# The GPU device check (issue 18): run on a GPU host that has no Rust toolchain and no network,
# from binaries built elsewhere. Writes $OUT/report.json (baton device-check's report plus the
# pipeline runs) and nvidia-smi's view. `--dry-run` runs every step on this CPU instead, so the
# script is proven before a GPU is lent.
#
#   cargo build --release -p baton-coordinator --features cuda --bin baton
#   cargo build --release -p baton-bench --bin baton-bench
#   bench/gpu/pack.sh                      # strips both into target/gpu/ with a tokenizer file
#   OUT=/tmp/check bench/gpu/check.sh      # on the GPU host, from the repository root
#
# Models: the tiny transformers fixtures in tests/fixtures/tiny (real checkpoints), and
# synthetic GGUF files of SmolLM2-135M's, Llama 3 8B's and (8 layers of) Qwen3-30B-A3B's shapes
# (random Q8_0 weights, the default model's tokenizer) written here by `baton-bench synth`,
# since no weights can be downloaded on the GPU host.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/gpu}
OUT=${OUT:-/tmp/baton-gpu-check}
DEVICE=(--device cuda:0)
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DEVICE=(--dry-run) ;;
    --quick) QUICK=1 ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT/models"
start=$(date +%s)
log() { echo "[check $(( $(date +%s) - start ))s] $*" >&2; }

{ nvidia-smi || echo "nvidia-smi: not available"; } > "$OUT/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv > "$OUT/gpu.csv" 2>/dev/null || true

TOK="$BIN/tokenizer.gguf"
small="$OUT/models/smollm2-shape.q8_0.gguf"
big="$OUT/models/llama3-8b-shape.q8_0.gguf"
log "synthesizing models"
"$BIN/baton-bench" synth --out "$small" --arch llama --layers 30 --hidden 576 --ffn 1536 --heads 9 \
  --kv-heads 3 --head-dim 64 --tokenizer-from "$TOK" >&2 || log "synth small failed"
speed=(--speed-model "$small")
moe="$OUT/models/qwen3-30b-a3b-shape-8-layers.q8_0.gguf"
if [ "$QUICK" = 0 ]; then
  timeout 120 "$BIN/baton-bench" synth --out "$big" --preset llama3-8b --tokenizer-from "$TOK" >&2 || log "synth 8b failed"
  speed+=(--speed-model "$big")
  # Qwen3-30B-A3B's layers (128 experts, 8 a token), 8 of its 48: the experts in one go.
  timeout 120 "$BIN/baton-bench" synth --out "$moe" --preset qwen3-30b-a3b --layers 8 --tokenizer-from "$TOK" >&2 \
    || log "synth moe failed"
  speed+=(--speed-model "$moe")
fi
ls -la "$OUT/models" >&2

parity=()
for m in llama_tied llama_untied qwen2 qwen3 qwen3_moe qwen3_moe_dense_mix qwen3_next qwen3_5 qwen3_5_moe; do parity+=(--parity-model "tests/fixtures/tiny/$m"); done
parity+=(--parity-model "$small")
log "device-check"
extra=()
if [ "${DEVICE[0]}" = --dry-run ]; then extra=(--prefill-tokens 256 --decode-steps 4); fi
timeout 300 "$BIN/baton" device-check "${DEVICE[@]}" "${parity[@]}" "${speed[@]}" "${extra[@]}" --out "$OUT/report.json" \
  2> "$OUT/device-check.log"
echo "device-check exit $?" >> "$OUT/device-check.log"
tail -5 "$OUT/device-check.log" >&2

# `baton generate` in this process on the device and on the CPU: greedy tokens (f32 weights).
gen() {
  "$BIN/baton" generate --model tests/fixtures/tiny/llama_tied --tokens 1,2,3 --max-tokens 24 --ignore-eos \
    --weights f32 --format json --device "$1" 2>&1 | tail -1
}
if [ "${DEVICE[0]}" = --dry-run ]; then gen_device=cpu:2; else gen_device=cuda:0; fi
{ echo "device $gen_device: $(gen "$gen_device")"; echo "cpu:1: $(gen cpu:1)"; } > "$OUT/generate.txt"
cat "$OUT/generate.txt" >&2

# Pipelines through `baton serve`: one GPU stage, two worker processes on the one GPU, and a
# GPU stage plus a CPU stage (split by measured cost). Each answers a warm-up request, then a
# greedy 128-token completion (batch 1) is timed.
serve_run() {
  local name=$1 workers=$2 devices=$3 port=$4 limit=${5:-90}
  log "serve $name"
  BATON_HOME="$OUT/home" BATON_CLUSTER_TOKEN=check timeout "$limit" "$BIN/baton" serve --model "$small" \
    --workers "$workers" --device "$devices" --port "$port" > "$OUT/serve-$name.log" 2>&1 &
  local pid=$! ready=0
  for _ in $(seq 1 "$limit"); do
    if curl -sf "localhost:$port/ready" >/dev/null 2>&1; then ready=1; break; fi
    sleep 1
  done
  if [ "$ready" = 1 ]; then
    curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' \
      -d '{"prompt":"Hello","max_tokens":8,"temperature":0}' > /dev/null
    local t0 t1
    t0=$(date +%s.%N)
    curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' \
      -d '{"prompt":"The quick brown fox","max_tokens":128,"temperature":0,"ignore_eos":true}' > "$OUT/serve-$name.json"
    t1=$(date +%s.%N)
    # Sampled on the device (temperature, top-p, min-p): twice with one seed, so the same text.
    local sampled='{"prompt":"Once upon a time","max_tokens":32,"temperature":0.8,"top_p":0.9,"min_p":0.02,"seed":7}'
    curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' -d "$sampled" > "$OUT/serve-$name-sampled-1.json"
    curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' -d "$sampled" > "$OUT/serve-$name-sampled-2.json"
    local same=no
    if cmp -s <(grep -o '"text":"[^"]*"' "$OUT/serve-$name-sampled-1.json") \
      <(grep -o '"text":"[^"]*"' "$OUT/serve-$name-sampled-2.json") \
      && grep -q '"text"' "$OUT/serve-$name-sampled-1.json"; then same=yes; fi
    echo "$name seeded sampling repeats: $same" >> "$OUT/pipelines.txt"
    curl -s "localhost:$port/admin/cluster" > "$OUT/cluster-$name.json" 2>/dev/null
    echo "$name workers=$workers devices=$devices seconds=$(awk "BEGIN{print $t1 - $t0}")" >> "$OUT/pipelines.txt"
  else
    echo "$name workers=$workers devices=$devices NOT READY (see serve-$name.log)" >> "$OUT/pipelines.txt"
  fi
  kill -INT "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}
if [ "${DEVICE[0]}" = --dry-run ]; then
  gpu=cpu:1; gpu2=cpu:1,cpu:1; mixed=cpu:1,cpu:1
else
  gpu=cuda:0; gpu2=cuda:0,cuda:0; mixed=cuda:0,cpu
fi
log "pipelines"
serve_run one-stage 1 "$gpu" 18431
serve_run two-stages-one-gpu 2 "$gpu2" 18432
serve_run gpu-plus-cpu 2 "$mixed" 18433
if [ "$QUICK" = 0 ]; then
  small="$big"
  serve_run 8b-one-stage 1 "$gpu" 18434 120
  serve_run 8b-two-stages-one-gpu 2 "$gpu2" 18435 120
fi
cat "$OUT/pipelines.txt" >&2
# Few files come back from a lent GPU host: fold the per-run files into three.
for f in "$OUT"/serve-*.json; do echo "$f: $(grep -o '"text":"[^"]*"' "$f")"; done > "$OUT/completions.txt"
for f in "$OUT"/serve-*.log; do echo "== $f"; tail -n 40 "$f"; done > "$OUT/serve-logs.txt"
for f in "$OUT"/cluster-*.json; do echo "== $f"; cat "$f"; echo; done > "$OUT/clusters.txt"
rm -f "$OUT"/serve-*.json "$OUT"/serve-*.log "$OUT"/cluster-*.json
rm -rf "$OUT/models" "$OUT/home"
cut -c1-300 "$OUT/completions.txt" >&2
log "done"
