#!/usr/bin/env python3
"""Write a random-weight Qwen3.5 text model (Gated DeltaNet and gated attention layers) with
real head shapes, to measure the hybrid paths where no real checkpoint can be downloaded.

    python3 bench/make_hybrid.py OUT_DIR --tokenizer-from DIR [--hidden 1024 --layers 8
        --pattern LLLF --intermediate 3072 --seed 0]

The defaults give 184 M parameters (embeddings tied): hidden 1024, layers [L, L, L, F] x 2, linear attention
with 8 key and 16 value heads of 128, attention with 8 heads of 128 and 2 K/V heads, MLP 3072,
vocabulary 49,152. The tokenizer files (tokenizer.json, tokenizer_config.json) are copied from
--tokenizer-from (a directory `baton convert` wrote from SmolLM2's GGUF fits the vocabulary).
Needs torch and transformers (>= 5, for Qwen3_5ForCausalLM): pip install torch transformers.
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer-from", type=Path, required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pattern", default="LLLF", help="layer kinds repeated: L linear, F full attention")
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    kinds = {"L": "linear_attention", "F": "full_attention"}
    layer_types = [kinds[a.pattern[i % len(a.pattern)]] for i in range(a.layers)]
    config = Qwen3_5TextConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        layer_types=layer_types,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(a.seed)
    model = Qwen3_5ForCausalLM(config).eval()
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = a.tokenizer_from / name
        if src.exists():
            shutil.copy(src, a.out / name)
    params = sum(t.numel() for t in model.parameters())
    print(f"{a.out}: {params / 1e6:.0f} M parameters, layers {''.join(k[0].upper() for k in layer_types)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
