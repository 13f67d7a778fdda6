"""GPU time of a call of one round as split launches (a send launch, then a receive launch) against one fused
launch, on one rank alone: cached dispatch + combine, the two paths alternated in one process.

    ./run.sh python benchmarks/fused_replay.py [--tokens 128,1024,4096] [--repeats 5] [--replays 50] [--out DIR]

One rank (a gloo group of one), hidden 7168 bf16, top-8 of 256 experts on a GPU (tiny shapes on CPU), random
routing, a buffer holding the call in one round. For each token count the script captures cached dispatch +
combine twice in a CUDA graph, once with ``TRITON_EP_FUSED=0`` (split launches) and once with ``=1`` (fused:
:func:`triton_ep.kernels.dispatch.dispatch_fused`, :func:`triton_ep.kernels.combine.combine_fused`; the
library's own choice is fused up to ``GPU_TUNING["fused"]["max_tokens"]`` tokens), then ``--repeats`` times
replays each graph 10 times unmeasured and ``--replays`` times between two CUDA events, alternately: GPU µs per
replay of the pair (graph replay: no host time in it). ``ratio`` = fused / split (above 1: the fused launch
takes more GPU time). The outputs of both graphs are compared bit for bit. The host time a fused launch saves
is ``benchmarks/host_cost.py``'s to show. On CPU (no CUDA graphs) each path's eager calls are timed under the
Triton interpreter: they show that both paths run and agree, nothing about speed. Output: a table, and
``<out>/fused_replay.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import triton_ep  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,1024,4096" if gpu else "16",
                   help="comma-separated token counts (one Buffer each)")
    C.add_replay_args(p, "alternations of the two paths")
    C.add_out_arg(p, "fused_replay.json")
    a = p.parse_args(argv)
    a.tokens = C.int_list(p, "tokens", a.tokens, 1)
    C.check_shape_args(p, a, ("hidden", "experts", "topk", "repeats", "replays"), 8, "rows of 16 bytes")
    return a


def _timer(step, dev: torch.device):
    """``(run, out)``: ``run(n)`` gives the µs per call of ``n`` calls of ``step`` (GPU: replays of its graph, by
    CUDA events; CPU: eager calls, by the wall clock), ``out()`` the outputs of the last one."""
    if dev.type != "cuda":
        last = [step()]                 # (a first call, unmeasured, as the GPU's capture: no one-time cost timed)

        def run_cpu(n):
            t0 = time.perf_counter()
            for _ in range(n):
                last[:] = [step()]
            return (time.perf_counter() - t0) * 1e6 / n
        return run_cpu, lambda: last[0]
    step()
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()

    def run_gpu(n):
        for _ in range(10):
            g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            g.replay()
        e.record()
        torch.cuda.synchronize(dev)
        return s.elapsed_time(e) * 1000 / n
    return run_gpu, lambda: out


def one_size(a, T: int, dev: torch.device) -> dict:
    """Both paths at ``T`` tokens: their µs per call over the repeats and whether their outputs agree."""
    gen = torch.Generator().manual_seed(7)
    x = C.random_rows(T, a.hidden, gen, dev)
    idx = C.random_topk(T, a.topk, a.experts, gen, dev)
    w = torch.rand(idx.shape, generator=gen).to(dev)
    buf = triton_ep.Buffer(dist.group.WORLD, max(1 << 22, T * (a.hidden * 2 + 512) * 2), device=dev)
    try:
        pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, a.experts)
        handle = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe, topk_idx=idx,
                              topk_weights=w)[4]

        def step():
            recv = buf.dispatch(x, handle=handle)[0]
            return recv, buf.combine(recv, handle)[0]
        timers = {}
        for mode in ("0", "1"):         # TRITON_EP_FUSED is read per call: each graph keeps the path it captured
            os.environ["TRITON_EP_FUSED"] = mode
            timers[mode] = _timer(step, dev)
        us = {"0": [], "1": []}
        for _ in range(a.repeats):
            for mode in ("0", "1"):
                os.environ["TRITON_EP_FUSED"] = mode
                us[mode].append(timers[mode][0](a.replays))
        outs = [timers[m][1]() for m in ("0", "1")]
        same = all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(*outs))
        split, fused = statistics.median(us["0"]), statistics.median(us["1"])
        return dict(tokens=T, split_us=split, fused_us=fused, ratio=fused / split, split_all=us["0"],
                    fused_all=us["1"], results_equal=same)
    finally:
        os.environ.pop("TRITON_EP_FUSED", None)
        buf.destroy()


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        try:
            for T in C.progress(a.tokens, desc="fused_replay"):
                rows.append(one_size(a, T, dev))
        finally:
            dist.destroy_process_group()
    what = ("GPU µs per CUDA-graph replay of cached dispatch + combine, median of the repeats" if dev.type == "cuda"
            else "CPU: µs per eager call under the Triton interpreter; they say nothing about GPU speed")
    print(f"[fused_replay] {C.device_name()}, one rank, hidden {a.hidden}, top-{a.topk} of {a.experts}: {what}")
    print(f"{'tokens':>7} {'split us':>10} {'fused us':>10} {'ratio':>7}  results equal")
    for r in rows:
        print(f"{r['tokens']:>7} {r['split_us']:>10.1f} {r['fused_us']:>10.1f} {r['ratio']:>7.3f}  {r['results_equal']}")
    path = os.path.join(a.out, "fused_replay.json")
    C.write_json(path, dict(device=C.device_name(), ranks=1, hidden=a.hidden, experts=a.experts, topk=a.topk,
                            repeats=a.repeats, replays=a.replays, note=what, results=rows))
    return 0 if all(r["results_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
