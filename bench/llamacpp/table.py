#!/usr/bin/env python3
"""Markdown tables for the llama.cpp comparisons (stdlib only).

    table.py kernels DIR   DIR holds llama-r<R>-t<T>.json (llama-bench -o json) and
                           baton-r<R>-t<T>.jsonl (baton-bench reference, one JSON object a line)
    table.py serving DIR   DIR holds <label>.json (baton-bench load --format json), one per
                           server, and servers.txt (one "label<TAB>description" a line, in order)
"""

import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def fmt(x, digits=1):
    return "–" if x is None else f"{x:.{digits}f}"


def spread(values):
    values = sorted(values)
    return f"{statistics.median(values):.1f} [{values[0]:.1f}–{values[-1]:.1f}]"


def kernels(d: Path) -> None:
    # (test, threads) -> list of tok/s, one per round
    llama, baton = defaultdict(list), defaultdict(list)
    meta = {}
    for f in sorted(d.glob("llama-r*-t*.json")):
        for e in json.loads(f.read_text()):
            test = f"pp{e['n_prompt']}" if e["n_gen"] == 0 else f"tg{e['n_gen']}"
            llama[(test, int(e["n_threads"]))].append(float(e["avg_ts"]))
            meta.setdefault("llama", f"llama.cpp {e.get('build_commit', '?')} (build {e.get('build_number', '?')}), "
                            f"{e.get('model_type', '?')}, {e.get('cpu_info', '?')}, backend {e.get('backends', '?')}")
    for f in sorted(d.glob("baton-r*-t*.jsonl")):
        for line in f.read_text().splitlines():
            if not line.startswith("{"):
                continue
            e = json.loads(line)
            if e.get("engine") != "cpu" or e.get("weights") != os.environ.get("BATON_WEIGHTS", "q8_0"):
                continue
            t = int(e["threads"])
            baton[(f"pp{e['prompt_tokens']}", t)].append(float(e["prefill_tok_per_s"]))
            baton[(f"tg{e['gen_tokens']}", t)].append(float(e["decode_tok_per_s"]))
            meta.setdefault("baton", f"Baton {e.get('weights')}, kernel path {e.get('kernel_path')}, {e.get('model')}")
    if not llama and not baton:
        sys.exit(f"table.py: no results in {d}")
    for k in ("llama", "baton"):
        if k in meta:
            print(f"* {meta[k]}")
    print()
    print("| test | threads | llama.cpp tok/s median [min–max] | Baton tok/s median [min–max] | Baton / llama.cpp | rounds |")
    print("|---|---|---|---|---|---|")
    keys = sorted(set(llama) | set(baton), key=lambda k: (k[0][:2] != "pp", k[0], k[1]))
    for key in keys:
        lv, bv = llama.get(key, []), baton.get(key, [])
        ratio = statistics.median(bv) / statistics.median(lv) if lv and bv else None
        rounds = f"{len(lv)}" if len(lv) == len(bv) else f"{len(lv)} / {len(bv)}"
        print(f"| {key[0]} | {key[1]} | {spread(lv) if lv else '–'} | {spread(bv) if bv else '–'} "
              f"| {fmt(ratio, 2)} | {rounds} |")


def serving(d: Path) -> None:
    servers = []  # (label, description)
    for line in (d / "servers.txt").read_text().splitlines():
        if line.strip():
            label, _, desc = line.partition("\t")
            servers.append((label, desc or label))
    results = {}
    for label, _ in servers:
        f = d / f"{label}.json"
        try:
            results[label] = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            print(f"* {label}: no result ({e})")
    ms = lambda s, k: None if not s else s[k] * 1e3  # noqa: E731
    print("| server | concurrency | ok/failed | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | E2E p50 s |")
    print("|---|---|---|---|---|---|---|---|")
    agg = {}  # (label, concurrency) -> out tok/s
    for label, desc in servers:
        r = results.get(label)
        if not r:
            continue
        for lv in r["levels"]:
            c = lv["concurrency"]
            failed = lv["requests_failed"] + lv["requests_not_sent"]
            tps = lv["output_tok_per_s"]
            agg[(label, c)] = tps if lv["requests_ok"] and not failed else None
            tps_s = fmt(tps) if not failed else f"({fmt(tps)})"
            ttft, itl, tpot, e2e = lv["ttft_s"], lv["itl_s"], lv["tpot_s"], lv["e2e_s"]
            print(f"| {desc} | {c} | {lv['requests_ok']}/{failed} | {tps_s} "
                  f"| {fmt(ms(ttft, 'p50'), 0)} / {fmt(ms(ttft, 'p99'), 0)} "
                  f"| {fmt(ms(itl, 'p50'))} / {fmt(ms(itl, 'p99'))} "
                  f"| {fmt(ms(tpot, 'p50'))} | {fmt(e2e and e2e['p50'], 2)} |")
            if lv.get("first_error"):
                print(f"|  | first error: {lv['first_error'][:120]} | | | | | | |")
    levels = sorted({c for (_, c) in agg})
    if not levels:
        return
    lo, hi = levels[0], levels[-1]

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    desc = dict(servers)
    print()
    print("| ratio | value |")
    print("|---|---|")
    if "llama-server" in desc and "baton-1x2" in desc:
        r = ratio(agg.get(("baton-1x2", hi)), agg.get(("llama-server", hi)))
        print(f"| {desc['baton-1x2']} ÷ {desc['llama-server']}, out tok/s at {hi} streams | {fmt(r, 2)} |")
    if "baton-1x2" in desc and "baton-2x1" in desc:
        r = ratio(agg.get(("baton-2x1", hi)), agg.get(("baton-1x2", hi)))
        print(f"| {desc['baton-2x1']} ÷ {desc['baton-1x2']}, out tok/s at {hi} streams | {fmt(r, 2)} |")
    if hi != lo:
        for label, d_ in servers:
            r = ratio(agg.get((label, hi)), agg.get((label, lo)))
            print(f"| batching gain {d_}: out tok/s at {hi} streams ÷ at {lo} | {fmt(r, 2)} |")
    print()
    print("Rows with failures are in parentheses and left out of the ratios (–).")


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("kernels", "serving"):
        sys.exit(__doc__)
    (kernels if sys.argv[1] == "kernels" else serving)(Path(sys.argv[2]))


if __name__ == "__main__":
    main()
