#!/usr/bin/env bash
# Put what bench/gpu/check.sh needs on a GPU host into target/gpu/ (carried there; it must stay
# under 60 MiB): the CUDA build of `baton`, `baton-bench` (for `synth`), both stripped, and a
# tokenizer file (the default model's vocabulary in a one-layer synthetic GGUF of 3 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}/release
mkdir -p target/gpu
strip -o target/gpu/baton "$T/baton"
strip -o target/gpu/baton-bench "$T/baton-bench"
target/gpu/baton-bench synth --out target/gpu/tokenizer.gguf --arch llama --layers 1 --hidden 64 --ffn 128 \
  --heads 2 --kv-heads 1 --head-dim 32 >/dev/null
du -sh target/gpu/*
