"""llama.cpp's own greedy tokens on the tiny fixtures its converter wrote
(tests/fixtures/llamacpp/*.gguf, F32) against transformers' (each fixture's reference.json):
an independent implementation checked on the same files Baton's tests read. Baton is held to
the same references by tests/tests/hybrid.rs.

    python3 bench/llamacpp/greedy-tiny.py [--server /opt/llama-x-build/bin/llama-server] [--port 8420]

Needs a llama-server that has these architectures (bench/llamacpp/build.sh with
LLAMA_PACKAGE=xllamacpp). A file llama.cpp refuses to load is reported as such: its loader
requires equal key and value head widths for the linear-attention layers, which two of the
fixtures do not have.
"""

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def started(server: subprocess.Popen, port: int) -> bool:
    for _ in range(80):
        if server.poll() is not None:
            return False
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return True
        except OSError:
            time.sleep(0.25)
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="/opt/llama-x-build/bin/llama-server")
    ap.add_argument("--port", type=int, default=8420)
    args = ap.parse_args()
    for gguf in sorted((FIXTURES / "llamacpp").glob("*.gguf")):
        name = gguf.stem
        cmd = [args.server, "-m", str(gguf), "-t", "2", "--port", str(args.port), "-c", "256", "-np", "1"]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if not started(server, args.port):
                print(f"{name}: llama.cpp did not load it")
                continue
            ref = json.loads((FIXTURES / "tiny" / name / "reference.json").read_text())
            same = total = 0
            for case in ref["greedy"]:
                got = post(args.port, "/completion", {
                    "prompt": case["prompt"], "n_predict": case["max_new_tokens"], "temperature": 0,
                    "top_k": 1, "return_tokens": True, "cache_prompt": False, "ignore_eos": True,
                })["tokens"]
                same += sum(a == b for a, b in zip(got, case["tokens"]))
                total += len(case["tokens"])
            print(f"{name}: llama.cpp's greedy tokens equal transformers' at {same} of {total} positions")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
