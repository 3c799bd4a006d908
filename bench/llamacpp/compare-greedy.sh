#!/usr/bin/env bash
# Greedy tokens of llama.cpp's llama-server and `baton serve` on one GGUF (e.g. a synthetic
# Qwen3-MoE from `baton-bench synth`): an independent implementation of the architecture checks
# Baton's (routing, expert layout, norms), where no transformers reference exists for the file.
# Both read the file's Q8_0 blocks as stored (Baton `--weights native`) and quantize
# activations per 32-value block, so their logits differ slightly; on a clear greedy path the
# tokens agree. Prompts are token ids, so no chat template or tokenizer difference enters.
#
#   MODEL=/opt/synth/qwen3-30b-a3b-8l.gguf  GEN=16  LLAMA_BUILD=/opt/llama.cpp-build
#   BATON=target/release/baton  PORTS="8400 8401"
set -euo pipefail
MODEL=${MODEL:?set MODEL to a GGUF file}
GEN=${GEN:-16}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BATON=${BATON:-$REPO/target/release/baton}
read -r LPORT BPORT <<<"${PORTS:-8400 8401}"
die() { echo "compare-greedy: $*" >&2; exit 1; }
[[ -x "$LLAMA_BUILD/bin/llama-server" ]] || die "llama-server missing: run bench/llamacpp/build.sh"
[[ -x "$BATON" ]] || die "$BATON missing: cargo build --release -p baton-coordinator"

"$LLAMA_BUILD/bin/llama-server" -m "$MODEL" -t 2 --port "$LPORT" -c 512 >/tmp/compare-greedy-llama.log 2>&1 &
LPID=$!
"$BATON" serve --model "$MODEL" --workers 0 --weights native --port "$BPORT" >/tmp/compare-greedy-baton.log 2>&1 &
BPID=$!
trap 'kill $LPID $BPID 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "127.0.0.1:$LPORT/health" >/dev/null && curl -sf "127.0.0.1:$BPORT/ready" >/dev/null && break
    sleep 2
done
NAME=$(curl -sf "127.0.0.1:$BPORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

same=0 total=0
for prompt in "[1,504,2128,314,4946,30,216]" "[9519,253,1345,2063,28,1782,253,2063,30,3200,3210,44,57,36,43]" "[28,29,30,31,32,33,34,35]"; do
    l=$(curl -sf "127.0.0.1:$LPORT/completion" -d "{\"prompt\":$prompt,\"n_predict\":$GEN,\"temperature\":0,\"top_k\":1,\"return_tokens\":true,\"cache_prompt\":false}" \
        | python3 -c 'import json,sys; print(" ".join(map(str, json.load(sys.stdin)["tokens"])))')
    # Baton returns token strings; map them back to ids with llama-server's own tokenizer.
    b=$(curl -sf "127.0.0.1:$BPORT/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$NAME\",\"prompt\":$prompt,\"max_tokens\":$GEN,\"temperature\":0,\"logprobs\":0}" \
        | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["choices"][0]["logprobs"]["tokens"]))' \
        | python3 -c '
import json, sys, urllib.request
ids = []
for t in json.load(sys.stdin):
    req = urllib.request.Request("http://127.0.0.1:'"$LPORT"'/tokenize", data=json.dumps({"content": t}).encode())
    ids += json.load(urllib.request.urlopen(req))["tokens"]
print(" ".join(map(str, ids)))')
    echo "prompt $prompt"
    echo "  llama.cpp: $l"
    echo "  Baton:     $b"
    n=$(python3 -c 'import sys; a, b = sys.argv[1].split(), sys.argv[2].split(); print(sum(x == y for x, y in zip(a, b)), len(a))' "$l" "$b")
    read -r s t <<<"$n"
    same=$((same + s)) total=$((total + t))
done
echo "greedy tokens equal at $same of $total positions"
