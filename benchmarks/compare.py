"""Before / after: the figures two runs of one benchmark share, side by side, with ``ratio`` = after / before.

    ./run.sh python benchmarks/compare.py BEFORE.json AFTER.json --out DIR [--name NAME]

Reads the JSON of ``bench_low_latency.py`` (every call's µs in ``results``, and with ``--profile`` each kernel's
GPU µs per graph replay), ``bench_kernels.py`` (each kernel's median µs per shape), ``host_cost.py`` (each
call's median host µs) or ``grid_cap.py`` (each setting's GPU µs per replay and its fraction of the copy ceiling,
per token count). Both files must come from the same script; a figure only one of them has is left out.
A ratio below 1 means the after run was quicker. Writes ``<out>/<name>.json`` (rows of ``what``, ``unit``,
``before``, ``after``, ``ratio``, and both files' device and path) and ``<out>/<name>.png`` (the ratios as
bars; needs matplotlib), and prints the table. The figures mean what their script says they mean: compare
runs made on the same kind of machine, ideally in one session.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def figures(doc: dict) -> Tuple[str, Dict[str, Tuple[float, str]]]:
    """``(kind, {name: (value, unit)})`` of one result file.

    Raises:
        ValueError: a JSON this script does not know.
    """
    out: Dict[str, Tuple[float, str]] = {}
    if "kernels" in doc and isinstance(doc["kernels"], list):                  # bench_kernels.py
        for k in doc["kernels"]:
            out[f"T={k['tokens']} {k['kernel']}"] = (k["ours_us"], "GPU us")
        return "bench_kernels", out
    if isinstance(doc.get("results"), list) and doc["results"] and "dispatch_frac" in doc["results"][0]:   # grid_cap.py
        for c in doc["results"]:
            for call in ("dispatch", "combine"):
                out[f"T={c['tokens']} {c['setting']} {call}"] = (c[f"{call}_us"], "GPU us")
                out[f"T={c['tokens']} {c['setting']} {call} frac"] = (c[f"{call}_frac"], "of the copy ceiling")
        return "grid_cap", out
    if isinstance(doc.get("results"), list):                                   # host_cost.py
        for c in doc["results"]:
            out[c["call"]] = (c["host_us"], "host us")
        return "host_cost", out
    if isinstance(doc.get("results"), dict) and "graph" in doc["results"]:    # bench_low_latency.py
        for name, v in doc["results"].items():
            if v is not None:
                out[name] = (v, "host us" if name.endswith("_host") else "GPU us")
        for name, (_, us) in (doc.get("kernels_per_replay") or {}).items():
            out[f"replay: {name}"] = (us, "GPU us")
        return "bench_low_latency", out
    raise ValueError("not a JSON of bench_low_latency.py, bench_kernels.py, host_cost.py or grid_cap.py")


def compare(before: dict, after: dict) -> list:
    """Rows of the figures both files have, in the after file's order."""
    kb, fb = figures(before)
    ka, fa = figures(after)
    if kb != ka:
        raise ValueError(f"the files come from different scripts ({kb}, {ka})")
    return [dict(what=name, unit=unit, before=fb[name][0], after=v, ratio=v / fb[name][0] if fb[name][0] else None)
            for name, (v, unit) in fa.items() if name in fb]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--name", default="compare", help="output file name, without extension")
    C.add_out_arg(p, "compare.json")
    a = p.parse_args(argv)
    docs = []
    for path in (a.before, a.after):
        with open(path) as f:
            docs.append(json.load(f))
    rows = compare(*docs)
    C.print_table(["figure", "unit", "before", "after", "ratio"],
                  [[r["what"], r["unit"], C.sig(r["before"], 4), C.sig(r["after"], 4), C.sig(r["ratio"], 3)]
                   for r in rows])
    C.write_json(os.path.join(a.out, a.name + ".json"),
                 dict(note="ratio = after / before (below 1: the after run was quicker)",
                      before=dict(path=a.before, device=docs[0].get("device")),
                      after=dict(path=a.after, device=docs[1].get("device")), rows=rows))
    C.bar_chart(os.path.join(a.out, a.name + ".png"), [r["what"] for r in rows],
                {"after / before": [r["ratio"] or 0.0 for r in rows]}, f"{a.name}: after / before", "ratio", hline=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
