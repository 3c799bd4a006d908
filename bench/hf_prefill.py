#!/usr/bin/env python3
"""Prefill throughput of Hugging Face transformers (PyTorch, fp32) on SmolLM2-135M's GGUF.

One forward pass over a PROMPT-token prompt (no KV cache kept, no sampling), timed after one
warm-up pass, median of --reps; prints one JSON object per thread count. The weights are the
GGUF's, dequantized to f32 by transformers, as in tests/fixtures/generate.py.

    python bench/hf_prefill.py --gguf PATH [--threads 1,2] [--tokens 512] [--reps 3]

Run by bench/hf-prefill-ab.sh beside `baton bench prefill`. Needs tests/fixtures/requirements.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per thread count")
    args = ap.parse_args()
    if not os.path.isfile(args.gguf):
        print(f"hf_prefill: no such GGUF file: {args.gguf}", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM

    name = os.path.basename(args.gguf)
    with tempfile.TemporaryDirectory() as tmp:
        # transformers wants (directory, gguf_file name): link the file into a temp dir.
        os.symlink(os.path.abspath(args.gguf), os.path.join(tmp, name))
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    vocab = model.config.vocab_size
    # A fixed, ordinary token sequence: prefill cost does not depend on which tokens.
    ids = torch.tensor([[(7919 * i + 13) % vocab for i in range(args.tokens)]], dtype=torch.long)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        times = []
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)  # warm-up
            for _ in range(args.reps):
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        print(
            json.dumps(
                {
                    "program": "transformers",
                    "torch": torch.__version__,
                    "threads": threads,
                    "tokens": args.tokens,
                    "seconds": s,
                    "prefill_tok_per_s": args.tokens / s,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
