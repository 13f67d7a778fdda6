"""GPU time of a cached dispatch and of a combine at one rank for several caps of the normal-mode launches' grid,
the caps alternated in one process.

    ./run.sh python benchmarks/grid_cap.py [--tokens 2048,4096] [--caps 0,2,4,8,16] [--repeats 5] [--replays 50]
                                           [--out DIR]

The send and receive launches of normal-mode calls of more than one block (not the fused single launch of a
small call, not low-latency mode) take at most ``GPU_TUNING["grid"]["programs_per_sm"]`` programs per
multiprocessor, each looping over blocks; ``0`` gives a program per block (a token or a received row). Every
program of such a launch checks the round's flags when it starts and counts itself done with one
system-scope atomic when it ends, so the cap decides how often that is paid.

One rank (a gloo group of one), hidden 7168 bf16, top-8 of 256 experts on a GPU (tiny shapes on CPU), random
routing, a buffer holding the call in one round. For each token count and cap the script captures a cached
dispatch and, separately, a combine in CUDA graphs, then ``--repeats`` times replays each graph 10 times
unmeasured and ``--replays`` times between two CUDA events, cap after cap: GPU µs per replay (no host time in
it). ``floor_us``: the bytes a call must move at one rank (x read once, each record written once and read once,
the output written once: 4 x T rows) over the copy ceiling measured first (``dst.copy_(src)`` of 512 MiB, read
plus written bytes per second); ``*_frac`` = floor / time; ``*_ratio`` = time / the first cap's time (below 1:
quicker). Every cap's outputs are compared bit for bit with the first cap's. On CPU (no CUDA graphs) eager
calls run under the Triton interpreter with 4 "multiprocessors" (320 tokens: 5 blocks of the interpreter's 64,
so a cap of 1 makes programs loop): they show that the capped grids agree, nothing about speed. Output: a
table, and ``<out>/grid_cap.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)
from fused_replay import _timer  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import triton_ep  # noqa: E402
from triton_ep.kernels import _util  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="2048,4096" if gpu else "320",
                   help="comma-separated token counts (one Buffer each; past the fused launch's limit on a GPU)")
    p.add_argument("--caps", default="0,2,4,8,16" if gpu else "0,1",
                   help="comma-separated programs per multiprocessor (0: a program per block); the first is the "
                        "reference of every ratio and of the bitwise check")
    C.add_replay_args(p, "alternations of the caps")
    C.add_out_arg(p, "grid_cap.json")
    a = p.parse_args(argv)
    a.tokens = C.int_list(p, "tokens", a.tokens, 1)
    a.caps = C.int_list(p, "caps", a.caps, 0)
    if len(set(a.caps)) < len(a.caps):
        p.error(f"--caps names a cap twice: {a.caps}")
    C.check_shape_args(p, a, ("hidden", "experts", "topk", "repeats", "replays"), 8, "rows of 16 bytes")
    return a


def copy_ceiling(dev: torch.device):
    """Read plus written bytes per second of ``dst.copy_(src)`` over 512 MiB; ``None`` on CPU."""
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = C.bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 29) / (ms * 1e-3)


class _Cap:
    """``GPU_TUNING["grid"]["programs_per_sm"]`` (the interpreter's table on CPU) set to ``cap`` inside."""

    def __init__(self, cap: int) -> None:
        self.table, self.cap = _util.tuning("grid"), cap

    def __enter__(self):
        self.saved = self.table["programs_per_sm"]
        self.table["programs_per_sm"] = self.cap

    def __exit__(self, *exc) -> None:
        self.table["programs_per_sm"] = self.saved


def one_size(a, T: int, dev: torch.device, ceiling) -> list:
    """Every cap at ``T`` tokens: µs per cached dispatch and per combine over the repeats, outputs compared."""
    gen = torch.Generator().manual_seed(7)
    x = C.random_rows(T, a.hidden, gen, dev)
    idx = C.random_topk(T, a.topk, a.experts, gen, dev)
    w = torch.rand(idx.shape, generator=gen).to(dev)
    buf = triton_ep.Buffer(dist.group.WORLD, max(1 << 22, T * (a.hidden * 2 + 512) * 2), device=dev)
    try:
        pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, a.experts)
        recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                                                num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)
        timers = {}
        for cap in a.caps:             # each graph keeps the grid it was captured with
            with _Cap(cap):
                timers[cap] = (_timer(lambda: buf.dispatch(x, handle=handle)[0], dev),
                               _timer(lambda: buf.combine(recv, handle)[0], dev))
        us = {cap: ([], []) for cap in a.caps}
        for _ in range(a.repeats):
            for cap in a.caps:
                with _Cap(cap):
                    for i in (0, 1):
                        us[cap][i].append(timers[cap][i][0](a.replays))
        ref = [timers[a.caps[0]][i][1]().view(torch.int16) for i in (0, 1)]
        floor = None if ceiling is None else (x.numel() + 3 * recv.numel()) * x.element_size() / ceiling * 1e6
        rows = []
        for cap in a.caps:
            d, c = (statistics.median(us[cap][i]) for i in (0, 1))
            d0, c0 = (statistics.median(us[a.caps[0]][i]) for i in (0, 1))
            same = all(torch.equal(timers[cap][i][1]().view(torch.int16), ref[i]) for i in (0, 1))
            rows.append(dict(tokens=T, programs_per_sm=cap, dispatch_us=d, combine_us=c, dispatch_ratio=d / d0,
                             combine_ratio=c / c0, floor_us=floor,
                             dispatch_frac=None if floor is None else floor / d,
                             combine_frac=None if floor is None else floor / c,
                             dispatch_all=us[cap][0], combine_all=us[cap][1], results_equal=same))
        return rows
    finally:
        buf.destroy()


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    ceiling = copy_ceiling(dev)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        try:
            for T in C.progress(a.tokens, desc="grid_cap"):
                rows += one_size(a, T, dev, ceiling)
        finally:
            dist.destroy_process_group()
    what = ("GPU µs per CUDA-graph replay, median of the repeats; frac = the call's bytes at the copy ceiling / time"
            if dev.type == "cuda" else
            "CPU: µs per eager call under the Triton interpreter; they say nothing about GPU speed")
    print(f"[grid_cap] {C.device_name()}, one rank, hidden {a.hidden}, top-{a.topk} of {a.experts}: {what}")
    C.print_table(["tokens", "programs/SM", "dispatch us", "ratio", "frac", "combine us", "ratio", "frac", "equal"],
                  [[r["tokens"], r["programs_per_sm"], f"{r['dispatch_us']:.1f}", f"{r['dispatch_ratio']:.3f}",
                    "-" if r["dispatch_frac"] is None else f"{r['dispatch_frac']:.2f}", f"{r['combine_us']:.1f}",
                    f"{r['combine_ratio']:.3f}", "-" if r["combine_frac"] is None else f"{r['combine_frac']:.2f}",
                    r["results_equal"]] for r in rows])
    C.write_json(os.path.join(a.out, "grid_cap.json"),
                 dict(device=C.device_name(), ranks=1, hidden=a.hidden, experts=a.experts, topk=a.topk,
                      repeats=a.repeats, replays=a.replays, copy_ceiling_Bps=ceiling,
                      default_programs_per_sm=_util.tuning("grid")["programs_per_sm"], note=what, results=rows))
    return 0 if all(r["results_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
