#!/usr/bin/env bash
# Prefill of 512 tokens: Hugging Face transformers (PyTorch fp32, bench/hf_prefill.py) against
# `baton bench prefill` (f32 and q8_0 weights), same GGUF, same thread counts, interleaved round
# by round (transformers first in odd rounds, Baton first in even ones). Prints each run's tok/s
# and, per thread count, the ratio of the medians Baton ÷ transformers.
#
#   HF_PYTHON=/path/to/venv/bin/python bench/hf-prefill-ab.sh
#
#   HF_PYTHON     a Python with tests/fixtures/requirements.txt installed (required)
#   ROUNDS=2 THREADS=1,2 TOKENS=512 WEIGHTS=f32,q8_0   what to measure (defaults shown)
#   GGUF          the model (default: $BATON_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   OUT=DIR       keep the raw outputs there (default: a new directory under /tmp)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BATON="$REPO/target/release/baton"
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-1,2}
TOKENS=${TOKENS:-512}
WEIGHTS=${WEIGHTS:-f32,q8_0}
BATON_HOME=${BATON_HOME:-$HOME/.cache/baton}
GGUF=${GGUF:-$BATON_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-$(mktemp -d /tmp/hf-prefill-ab.XXXXXX)}
mkdir -p "$OUT"
[[ -n "${HF_PYTHON:-}" && -x "$HF_PYTHON" ]] || {
    echo "hf-prefill-ab: set HF_PYTHON to a Python with tests/fixtures/requirements.txt installed" >&2
    exit 2
}
[[ -x "$BATON" ]] || { echo "hf-prefill-ab: build first: cargo build --release --workspace" >&2; exit 1; }
[[ -f "$GGUF" ]] || { echo "hf-prefill-ab: no model at $GGUF (run: $BATON fetch)" >&2; exit 1; }

hf() { "$HF_PYTHON" "$REPO/bench/hf_prefill.py" --gguf "$GGUF" --threads "$THREADS" --tokens "$TOKENS" >>"$OUT/hf.jsonl" 2>>"$OUT/hf.log"; }
baton() {
    "$BATON" bench prefill --model "$GGUF" --weights "$WEIGHTS" --threads "$THREADS" --tokens "$TOKENS" \
        --reps 3 --format json 2>/dev/null >>"$OUT/baton.jsonl"
}

echo "hf-prefill-ab: $ROUNDS rounds; raw outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then hf; baton; else baton; hf; fi
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
rows = {}
for name in ("hf", "baton"):
    with open(f"{out}/{name}.jsonl") as f:
        for line in f:
            d = json.loads(line)
            who = "transformers fp32" if name == "hf" else f"baton {d['weights']}"
            rows.setdefault((who, d["threads"]), []).append(d["prefill_tok_per_s"])
threads = sorted({t for _, t in rows})
print("| program | threads | prefill tok/s (each round) | median | ÷ transformers |")
print("|---|---|---|---|---|")
for t in threads:
    base = statistics.median(rows[("transformers fp32", t)])
    for (who, tt), v in sorted(rows.items()):
        if tt != t:
            continue
        m = statistics.median(v)
        print(f"| {who} | {t} | {', '.join(f'{x:.1f}' for x in v)} | {m:.1f} | {m / base:.2f} |")
EOF
