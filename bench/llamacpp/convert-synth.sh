#!/usr/bin/env bash
# A synthetic mid-size model made the way the issue asks: random weights written by
# transformers at a released family's real shapes, converted to Q8_0 GGUF by llama.cpp's own
# convert_hf_to_gguf.py. SHAPE picks the model:
#
#   qwen3moe-1.5b (default)  Qwen3MoeForCausalLM: 1.5 B parameters, 12 layers, hidden 1536,
#                            48 experts of width 512, 4 active.
#   qwen3next-3b             Qwen3NextForCausalLM, 2.9 B parameters: Qwen3-Next-80B-A3B's per-layer shapes
#                            (hidden 2048; Gated DeltaNet with 16 key heads and 32 value heads of
#                            128; gated attention with 16 query / 2 KV heads of 256, a quarter
#                            rotated; a shared expert of 512) with 12 layers, three linear to
#                            one full, and 64 experts of width 512, 8 active (the released model
#                            has 48 layers and 512 experts, 10 active; fewer keep the file in
#                            this machine's memory twice over).
#   qwen35-1b                Qwen3_5ForCausalLM (Qwen3.5's dense text model), 0.95 B parameters:
#                            hidden 2048, Gated DeltaNet with 16 key and 32 value heads of 128
#                            (value heads stored key-head-minor by the converter), gated
#                            attention with 16 query / 4 KV heads of 256, a quarter rotated, a
#                            dense MLP of 6144; 12 layers, three linear to one full.
#
# The model carries SmolLM2's tokenizer (from `baton convert`), whose re-serialized
# tokenizer.json llama.cpp's converter does not recognize by hash, so the converter is run with
# its pre-tokenizer answer fixed to "smollm" (what it answers for SmolLM2's original files);
# nothing else of it is changed.
#
#   SHAPE=qwen3moe-1.5b  OUT=/opt/synth  PYTHON=python3 (with torch, transformers, numpy)
#   LLAMA_SRC=/opt/llama-src (as in build.sh; qwen3next needs LLAMA_PACKAGE=xllamacpp's tree,
#                             the older llama-cpp-python tree has no Qwen3-Next)
#   BATON=target/release/baton (for `baton convert` of the default model's tokenizer)
set -euo pipefail
SHAPE=${SHAPE:-qwen3moe-1.5b}
OUT=${OUT:-/opt/synth}
LLAMA_SRC=${LLAMA_SRC:-/opt/llama-src}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BATON=${BATON:-$REPO/target/release/baton}
case "$SHAPE" in qwen3moe-1.5b | qwen3next-3b | qwen35-1b) ;; *) echo "SHAPE must be qwen3moe-1.5b, qwen3next-3b or qwen35-1b, not '$SHAPE'" >&2; exit 1 ;; esac
LLAMA=""
for tree in "$LLAMA_SRC"/llama_cpp_python-*/vendor/llama.cpp "$LLAMA_SRC"/xllamacpp-*/thirdparty/llama.cpp; do
    [[ -f "$tree/convert_hf_to_gguf.py" ]] && { LLAMA=$tree; break; }
done
[[ -f "$LLAMA/convert_hf_to_gguf.py" ]] || { echo "no llama.cpp source under $LLAMA_SRC: run bench/llamacpp/build.sh" >&2; exit 1; }
HF="$OUT/$SHAPE-hf"
GGUF="$OUT/$SHAPE-q8_0.gguf"
mkdir -p "$OUT"

TOK=$(mktemp -d)
trap 'rm -rf "$TOK"' EXIT
rmdir "$TOK"
"$BATON" convert --out "$TOK" >/dev/null

"$PYTHON" - "$SHAPE" "$HF" "$TOK" <<'PY'
import shutil, sys, torch
import transformers as tf
shape, out, tok = sys.argv[1:4]
torch.manual_seed(0)
common = dict(vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, num_hidden_layers=12)
if shape == "qwen3moe-1.5b":
    cfg = tf.Qwen3MoeConfig(**common, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        num_experts=48, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cls = tf.Qwen3MoeForCausalLM
elif shape == "qwen35-1b":
    cfg = tf.Qwen3_5TextConfig(**common, hidden_size=2048, intermediate_size=6144,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
    cls = tf.Qwen3_5ForCausalLM
else:
    cfg = tf.Qwen3NextConfig(**common, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
    cls = tf.Qwen3NextForCausalLM
m = cls(cfg).to(torch.bfloat16)
print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.2f} B parameters", file=sys.stderr)
m.save_pretrained(out)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(f"{tok}/{f}", f"{out}/{f}")
PY

"$PYTHON" - "$LLAMA" "$HF" "$GGUF" "$SHAPE" <<'PY'
import runpy, sys
llama, hf, gguf_out, shape = sys.argv[1:5]
sys.path[:0] = [f"{llama}/gguf-py", llama]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", "q8_0", "--outfile", gguf_out]
if shape != "qwen3moe-1.5b":
    sys.argv.append("--no-mtp")  # the hybrids' converters otherwise require MTP tensors
runpy.run_path(f"{llama}/convert_hf_to_gguf.py", run_name="__main__")
PY
echo "$GGUF"
