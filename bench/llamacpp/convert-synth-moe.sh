#!/usr/bin/env bash
# A synthetic mid-size Qwen3-MoE made the way the issue asks: random weights written by
# transformers (Qwen3MoeForCausalLM, real shapes: 1.5 B parameters, 48 experts of width 512,
# 4 active, 12 layers, hidden 1536), converted to Q8_0 GGUF by llama.cpp's own
# convert_hf_to_gguf.py. The model carries SmolLM2's tokenizer (from `baton convert`), whose
# re-serialized tokenizer.json llama.cpp's converter does not recognize by hash, so the
# converter is run with its pre-tokenizer answer fixed to "smollm" (what it answers for
# SmolLM2's original files); nothing else of it is changed.
#
#   OUT=/opt/synth  LLAMA_SRC=/opt/llama-src  PYTHON=python3 (with torch, transformers, numpy)
#   BATON=target/debug/baton (for `baton convert` of the default model's tokenizer)
set -euo pipefail
OUT=${OUT:-/opt/synth}
LLAMA_SRC=${LLAMA_SRC:-/opt/llama-src}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BATON=${BATON:-$REPO/target/release/baton}
LLAMA=$(ls -d "$LLAMA_SRC"/llama_cpp_python-*/vendor/llama.cpp | head -1)
[[ -f "$LLAMA/convert_hf_to_gguf.py" ]] || { echo "no llama.cpp source under $LLAMA_SRC: run bench/llamacpp/build.sh" >&2; exit 1; }
HF="$OUT/qwen3moe-1.5b-hf"
GGUF="$OUT/qwen3moe-1.5b-q8_0.gguf"
mkdir -p "$OUT"

TOK=$(mktemp -d)
trap 'rm -rf "$TOK"' EXIT
rmdir "$TOK"
"$BATON" convert --out "$TOK" >/dev/null

"$PYTHON" - "$HF" "$TOK" <<'PY'
import shutil, sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
out, tok = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512,
    num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
    num_experts=48, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2)
m = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.2f} B parameters", file=sys.stderr)
m.save_pretrained(out)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(f"{tok}/{f}", f"{out}/{f}")
PY

"$PYTHON" - "$LLAMA" "$HF" "$GGUF" <<'PY'
import runpy, sys
llama, hf, gguf_out = sys.argv[1:4]
sys.path[:0] = [f"{llama}/gguf-py", llama]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", "q8_0", "--outfile", gguf_out]
runpy.run_path(f"{llama}/convert_hf_to_gguf.py", run_name="__main__")
PY
echo "$GGUF"
