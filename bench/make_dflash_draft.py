#!/usr/bin/env python3
"""Write a random-weight DFlash draft checkpoint for a target of a given shape, to measure what
drafting costs where no trained draft can be downloaded (its proposals are noise, so it
measures the machinery, not acceptance).

    python3 bench/make_dflash_draft.py OUT_DIR [--hidden 576 --heads 9 --kv-heads 3
        --head-dim 64 --vocab 49152 --taps 5,15,25 --layers 1 --block-size 8 --mask-token 0]

The defaults fit SmolLM2-135M (30 layers). Needs numpy and safetensors (pip install numpy
safetensors). The layout is the published one: config.json with block_size and
dflash_config.target_layer_ids / mask_token_id; tensors fc, hidden_norm, layers.N.*, norm.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--taps", default="5,15,25")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--mask-token", type=int, default=0)
    p.add_argument("--rope-theta", type=float, default=100000.0)
    p.add_argument("--max-positions", type=int, default=8192)
    a = p.parse_args()
    taps = [int(x) for x in a.taps.split(",")]
    rng = np.random.default_rng(0)
    h, nh, nkv, hd, inter = a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": mat(h, len(taps) * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for layer in range(a.layers):
        q = f"layers.{layer}."
        w[q + "input_layernorm.weight"] = norm(h)
        w[q + "post_attention_layernorm.weight"] = norm(h)
        w[q + "self_attn.q_proj.weight"] = mat(nh * hd, h)
        w[q + "self_attn.k_proj.weight"] = mat(nkv * hd, h)
        w[q + "self_attn.v_proj.weight"] = mat(nkv * hd, h)
        w[q + "self_attn.o_proj.weight"] = mat(h, nh * hd)
        w[q + "self_attn.q_norm.weight"] = norm(hd)
        w[q + "self_attn.k_norm.weight"] = norm(hd)
        w[q + "mlp.gate_proj.weight"] = mat(inter, h)
        w[q + "mlp.up_proj.weight"] = mat(inter, h)
        w[q + "mlp.down_proj.weight"] = mat(h, inter)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": a.block_size,
        "dflash_config": {"mask_token_id": a.mask_token, "target_layer_ids": taps},
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "max_position_embeddings": a.max_positions,
        "num_attention_heads": nh,
        "num_hidden_layers": a.layers,
        "num_key_value_heads": nkv,
        "rms_norm_eps": 1e-5,
        "rope_theta": a.rope_theta,
        "tie_word_embeddings": False,
        "vocab_size": a.vocab,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(w, str(a.out / "model.safetensors"))
    print(f"wrote a random DFlash draft ({a.layers} layers, taps {taps}, block {a.block_size}) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
