"""Host cost of each normal-mode call on one rank alone: the microseconds Python spends in a call (argument
checks, allocations, kernel launches, the plain dispatch's one host wait), and the kernel launches it makes.

    ./run.sh python benchmarks/host_cost.py [--tokens 128] [--iters 30] [--calls ...] [--cprofile] [--out DIR]
    ./run.sh python benchmarks/host_cost.py --against DIR [--tokens 128] [--iters 20] [--rounds 6] [--calls ...]
    ./run.sh python benchmarks/host_cost.py --diff BEFORE.json AFTER.json [--name NAME] [--out DIR]

One rank (a gloo group of one), hidden 7168 bf16, top-8 of 256 experts on a GPU (tiny shapes on CPU),
random routing, a buffer holding every transfer in one round (``--buffer round``, the default) or of DeepEP's size
hint for this hidden and one rank (``--buffer hint``: a T past the hint's rows takes several rounds, as at ``R``
ranks in a hint ``R`` times larger, benchmarks/host_counts.py). Per call: a device synchronise, then
``perf_counter`` around the one call; the median (and minimum) of ``--iters`` calls. This is what bounds a
small call from below when the GPU waits for the host. The dispatches take the layout
``get_dispatch_layout`` returned for their ``topk_idx`` (so they launch no layout of their own); ``ll_dispatch``
(FP8) and ``ll_combine`` are the low-latency calls on a low-latency Buffer of their own (N = tokens). Kernels
per call: on a GPU, the kernels ``torch.profiler`` sees in one call (driver launches count); on CPU, under
the Triton interpreter, calls of the kernel launchers of ``triton_ep.kernels`` (the times say nothing
about a GPU there).

On a GPU two further passes split each call's time: ``launch_us``, the time spent inside kernel launches
(:class:`triton_ep.kernels.launch.Launcher`, ``BoundLaunch`` and ``Replay`` calls: a replayed call's launches),
and ``alloc_us``, inside tensor allocations
(``torch.empty``, ``zeros``, ``full`` and their ``_like`` forms); ``host_us - launch_us - alloc_us`` is the
call's own Python. Two rows give this machine's floor for one launch, timed the same way: ``floor_torch``
(``Tensor.add_`` on 64 floats, PyTorch's own launch) and ``floor_triton`` (a one-line Triton kernel through
``Launcher``). The kernels each call makes are counted last, after every timing: once ``torch.profiler`` has
attached CUPTI, later launches in the process cost more (seen on an H200 host in one probe: a one-line Triton
kernel 9.0 -> 9.9 µs, ``Tensor.add_`` 7.9 -> 9.3 µs, ``torch.empty`` 2.3 -> 5.6 µs). Output: a table, and
``<out>/host_cost.json``.

**This checkout against another, in one process** (``--against DIR``: an A/B for a change of the launch path).
``DIR`` is another checkout of triton-ep (the folder holding its ``triton_ep`` package), e.g. a ``git worktree``
of the commit before a change. Both packages are imported into this process (the other one under the same
name, its modules kept apart), each builds the Buffers above (the same inputs), and every call of ``--calls`` is
timed in alternating blocks: ``--rounds`` blocks of ``--iters`` calls for each side, the side that goes first
alternating. Reported: the median host µs of each side, ``ratio`` = this checkout's median / the other's, and the
minimums, in ``<out>/host_cost_ab.json``. Why in one process: on the H200 machine the host cost of the same code
measured in two processes one after another differed by up to 2x from process to process, more than most
changes of the launch path are worth; in one process both sides see the same CPU, clocks and placement. Limits:
the other checkout must make the calls asked for with the same arguments (the low-latency Buffer is built only
when ``--calls`` names a low-latency call), and each package must import its modules when it is imported.

**Two result files side by side** (``--diff BEFORE.json AFTER.json``, nothing run): the figures two runs of one
script share, ``ratio`` = after / before (below 1: the after run was quicker). Reads the JSON of this script
(each call's median host µs), ``bench_low_latency.py`` (every call's µs, and with ``--profile`` each kernel's GPU
µs per graph replay), ``bench_kernels.py`` (each kernel's median µs per shape) or ``grid_cap.py`` (each setting's
GPU µs per replay and its fraction of the copy ceiling, per token count); a figure only one file has is left
out. Writes ``<out>/<--name>.json`` (rows of ``what``, ``unit``, ``before``, ``after``, ``ratio``) and ``.png``.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import triton_ep  # noqa: E402,F401  (before triton: it chooses the interpreter where there is no GPU)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton_ep.kernels import launch as _launch  # noqa: E402
from triton_ep.kernels.launch import Launcher  # noqa: E402

#: what a kernel launch goes through: a launcher's call, or a bound launch's (kernels/launch.py)
LAUNCHES = ([(Launcher, "_launch")] + ([(_launch.BoundLaunch, "__call__")] if hasattr(_launch, "BoundLaunch") else [])
            + ([(_launch.Replay, "__call__")] if hasattr(_launch, "Replay") else []))


#: the calls timed (``floor_*``: this machine's floor for one launch, GPU only, not with ``--against``)
CALLS = ("layout", "dispatch", "worst", "cached", "combine", "ll_dispatch", "ll_combine")


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128 if gpu else 16)
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--experts", type=int, default=256 if gpu else 16)
    p.add_argument("--topk", type=int, default=8 if gpu else 4)
    p.add_argument("--iters", type=int, default=None,
                   help="calls timed per call (default 30 on a GPU, 5 on CPU); with --against, calls per block "
                        "(default 20 on a GPU, 2 on CPU)")
    p.add_argument("--calls", nargs="+", choices=CALLS, default=list(CALLS))
    p.add_argument("--buffer", choices=("round", "hint"), default="round",
                   help="the normal Buffer's size: every transfer in one round, or DeepEP's size hint (rounds)")
    p.add_argument("--cprofile", action="store_true", help="also print the top of a cProfile of each call")
    p.add_argument("--against", metavar="DIR",
                   help="another checkout of triton-ep (the folder holding triton_ep/): time both in one process")
    p.add_argument("--rounds", type=int, default=6 if gpu else 2, help="with --against: blocks per side")
    p.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="two result files of one script side by side (nothing is run)")
    p.add_argument("--name", default="compare", help="with --diff: output file name, without extension")
    C.add_out_arg(p, "host_cost.json, host_cost_ab.json (--against) or <name>.json/.png (--diff)")
    a = p.parse_args(argv)
    if a.iters is None:
        a.iters = (20 if gpu else 2) if a.against else (30 if gpu else 5)
    if a.diff:
        if a.against:
            p.error("--diff compares two files: it takes no --against")
        return a
    C.check_shape_args(p, a, ("tokens", "hidden", "experts", "topk", "iters", "rounds"), 128,
                       "low-latency mode's rows")
    if a.against is not None:
        if not os.path.isdir(a.against):
            p.error(f"--against {a.against!r} is not a folder (give the folder of another checkout)")
        if not os.path.isfile(os.path.join(a.against, "triton_ep", "__init__.py")):
            p.error(f"--against {a.against!r} holds no triton_ep package (give the folder of another checkout)")
        if os.path.realpath(os.path.join(a.against, "triton_ep")) == os.path.realpath(os.path.dirname(triton_ep.__file__)):
            p.error("--against names this checkout itself")
    return a


def count_launches():
    """CPU: wrap every kernel launcher the Buffer uses, and the replays of a call's launches; returns the counter
    dict (launcher name -> calls)."""
    import triton_ep.kernels as K
    import triton_ep.kernels.notify as NT
    import triton_ep.modes.intranode as IN
    import triton_ep.modes.low_latency.calls as LL
    counter = {}
    for mod, names in ((K, ("routing_layout", "notify_send", "notify_recv", "dispatch_send", "dispatch_recv",
                            "combine_send", "combine_reduce")),
                       (NT, ("notify",)),                       # the count exchange as one launch
                       (IN, ("dispatch_fused", "combine_fused")),   # a call of one round as one launch
                       (LL, ("ll_fence", "ll_route", "ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send",
                             "ll_combine_reduce"))):
        for name in names:
            real = getattr(mod, name)

            def wrapped(*a, _real=real, _name=name, **k):
                counter[_name] = counter.get(_name, 0) + 1
                return _real(*a, **k)
            setattr(mod, name, wrapped)
    if hasattr(_launch, "Replay"):     # a replayed call's launches (modes/*_replay.py), by their wrapper's name
        real_replay = _launch.Replay.__call__

        def replayed(self, *a, **k):
            name = self.bound.launcher.name
            counter[name] = counter.get(name, 0) + 1
            return real_replay(self, *a, **k)
        _launch.Replay.__call__ = replayed
    return counter


def gpu_kernels(fn) -> dict:
    """GPU: the kernels ``torch.profiler`` records in one call of ``fn`` (name -> launches)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:48]: e.count for e in prof.key_averages()
            if e.count and (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0))}


def time_inside(fn, iters: int, sync, targets) -> float:
    """Median µs per call of ``fn`` spent inside the functions ``targets`` names (``(owner, attribute)``
    pairs), each wrapped by a timer for this pass only (nested calls are counted once)."""
    spent, depth = [0.0], [0]
    saved = [(o, n, getattr(o, n)) for o, n in targets]

    def wrap(real):
        def timed(*args, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.perf_counter() - t0
        return timed
    for o, n, real in saved:
        setattr(o, n, wrap(real))
    try:
        per = []
        for _ in range(iters):
            sync()
            spent[0] = 0.0
            fn()
            per.append(spent[0] * 1e6)
    finally:
        for o, n, real in saved:
            setattr(o, n, real)
    return statistics.median(per)


@triton.jit
def _floor_kernel(x_ptr, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)


def floor_calls(dev) -> dict:
    """This machine's floor for one launch: PyTorch's own (``add_`` on 64 floats) and a one-line Triton kernel
    through the library's :class:`Launcher`."""
    t = torch.zeros(64, device=dev)
    launch = Launcher(_floor_kernel)
    return {"floor_torch": lambda: t.add_(1), "floor_triton": lambda: launch[(1,)](t, 64, B=64, num_warps=1)}


#: the tensor allocations a call may make
ALLOCATORS = [(torch, n) for n in ("empty", "zeros", "full", "empty_like", "zeros_like", "full_like", "ones")]


def inputs(a, dev) -> tuple:
    """The calls' inputs: ``x`` bf16 ``[tokens, hidden]``, ``topk_idx`` int64 ``[tokens, topk]`` (random routing, seed
    7) and ``topk_weights`` fp32 ``[tokens, topk]`` on ``dev``."""
    gen = torch.Generator().manual_seed(7)
    x = C.random_rows(a.tokens, a.hidden, gen, dev)
    idx = C.random_topk(a.tokens, a.topk, a.experts, gen, dev)
    w = torch.rand(idx.shape, generator=gen).to(dev)
    return x, idx, w


def make_calls(lib, a, dev, x, idx, w, low_latency: bool = True) -> tuple:
    """Buffers of the package ``lib`` (``triton_ep``, or another copy of it: ``--against``) on the default
    group: a normal one (``a.buffer``: holding every transfer in one round, or of DeepEP's size hint) and, with
    ``low_latency``, a low-latency one (N =
    tokens). Returns ``(buffer, low_latency_buffer or None, calls, dispatch_kwargs)``; ``calls``: name -> a
    function making that call once (dispatches take the layout ``get_dispatch_layout`` returned, so they launch
    none of their own; ``ll_*`` only with ``low_latency``)."""
    made = []                   # destroyed again if a later step fails (the caller gets nothing to destroy)
    try:
        nbytes = (C.nvl_bytes_hint(a.hidden, 1) if a.buffer == "hint"
                  else max(1 << 22, a.tokens * (a.hidden * 2 + 512) * 2))
        buf = lib.Buffer(dist.group.WORLD, nbytes, device=dev)
        made.append(buf)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, a.experts)
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w)
        first = buf.dispatch(x, **kw)
        recv_x, handle = first[0], first[4]
        calls = {"layout": lambda: buf.get_dispatch_layout(idx, a.experts),
                 "dispatch": lambda: buf.dispatch(x, **kw),
                 "worst": lambda: buf.dispatch(x, num_worst_tokens=a.tokens, **kw),
                 "cached": lambda: buf.dispatch(x, handle=handle),
                 "combine": lambda: buf.combine(recv_x, handle)}
        if not low_latency:
            return buf, None, calls, kw
        hint = lib.Buffer.get_low_latency_rdma_size_hint(a.tokens, a.hidden, 1, a.experts)
        llbuf = lib.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=a.experts, device=dev)
        made.append(llbuf)
        ll = llbuf.low_latency_dispatch(x, idx, a.tokens, a.experts, use_fp8=False)
    except BaseException:
        for b in made:
            b.destroy()
        raise
    calls.update(ll_dispatch=lambda: llbuf.low_latency_dispatch(x, idx, a.tokens, a.experts, use_fp8=True),
                 ll_combine=lambda: llbuf.low_latency_combine(ll[0], idx, w, ll[2]))
    return buf, llbuf, calls, kw


def time_one(name: str, fn, a, sync, counter, gpu: bool) -> dict:
    """One call's row: median and minimum host µs of ``a.iters`` calls after 3 unmeasured ones, its launcher calls
    (CPU, ``counter``), on a GPU the µs inside launches and inside allocations; with ``--cprofile`` its profile."""
    for _ in range(3):
        fn()
    launches = None
    if counter is not None:
        counter.clear()
        fn()
        launches = dict(counter)
    ts = []
    for _ in range(a.iters):
        sync()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    sync()
    row = dict(call=name, host_us=statistics.median(ts), host_us_min=min(ts), launches=launches)
    if gpu and not name.startswith("floor"):
        row.update(launch_us=time_inside(fn, a.iters, sync, LAUNCHES), alloc_us=time_inside(fn, a.iters, sync, ALLOCATORS))
    if a.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.iters):
            fn()
        prof.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        print(f"--- cProfile of {name} ({a.iters} calls)\n{text.getvalue()}")
    return row


def run_one(a, dev) -> list:
    """This checkout's calls (and on a GPU the floor rows), one after another: their rows."""
    gpu = dev.type == "cuda"
    x, idx, w = inputs(a, dev)
    buf, llbuf, calls, kw = make_calls(triton_ep, a, dev, x, idx, w,
                                       low_latency=any(c.startswith("ll_") for c in a.calls))
    try:
        calls = {name: fn for name, fn in calls.items() if name in a.calls}
        if gpu:
            calls.update(floor_calls(dev))
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        counter = None if gpu else count_launches()

        def fresh_layout():
            """As a caller does: dispatch with the layout just computed for its topk_idx (the Buffer then
            launches no layout of its own)."""
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, a.experts)
            kw.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

        out = []
        for name, fn in C.progress(list(calls.items()), desc="host_cost"):
            if name == "dispatch":
                fresh_layout()
            out.append(time_one(name, fn, a, sync, counter, gpu))
        if gpu:
            # after every timing: CUPTI, once a profiler attached it, may slow later launches down
            for row in out:
                if row["call"] == "dispatch":
                    fresh_layout()
                row["launches"] = gpu_kernels(calls[row["call"]])
        return out
    finally:
        for b in (llbuf, buf):
            if b is not None:
                b.destroy()


def report_one(a, dev, out: list) -> None:
    """The table of :func:`run_one`'s rows, and ``<out>/host_cost.json``."""
    gpu = dev.type == "cuda"
    what = ("host µs of one call from Python on this machine (GPU: the call only enqueues work, except a plain "
            "dispatch's host wait)" if gpu else
            "CPU: kernels run inside the call under the Triton interpreter; the times say nothing about a GPU")
    C.say(f"[host_cost] {C.device_name()}, 1 rank, {a.tokens} tokens x {a.hidden}, top-{a.topk} of {a.experts}, "
          f"buffer: {a.buffer}; {what}")
    C.print_table(["call", "host us (median)", "min", "in launches us", "in allocations us",
                   "kernels" if gpu else "launcher calls", "per kernel"],
                  [[r["call"], C.sig(r["host_us"]), C.sig(r["host_us_min"]), C.sig(r.get("launch_us")),
                    C.sig(r.get("alloc_us")), sum(r["launches"].values()),
                    ", ".join(f"{k} {v}" for k, v in r["launches"].items())] for r in out])
    os.makedirs(a.out, exist_ok=True)
    C.write_json(os.path.join(a.out, "host_cost.json"),
                 dict(device=C.device_name(), ranks=1, ranks_per_gpu=1, tokens=a.tokens, hidden=a.hidden, buffer=a.buffer,
                      experts=a.experts, topk=a.topk, iters=a.iters, note=what, results=out))


# ------------------------------------------------------------------ --against: another checkout, same process
def load_other(path: str):
    """The ``triton_ep`` package of the checkout at ``path``, imported beside this checkout's: its modules are
    imported under their own names, then this checkout's are put back in ``sys.modules``."""
    mine = {k: v for k, v in sys.modules.items() if k == "triton_ep" or k.startswith("triton_ep.")}
    for k in mine:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(path))
    try:
        other = importlib.import_module("triton_ep")
    finally:
        sys.path.pop(0)
        for k in [k for k in sys.modules if k == "triton_ep" or k.startswith("triton_ep.")]:
            del sys.modules[k]
        sys.modules.update(mine)
    return other


def code_of(lib) -> str:
    """The file the ``Buffer`` class of package ``lib`` runs from (its methods' code, not the module name)."""
    return os.path.abspath(lib.Buffer.__init__.__code__.co_filename)


def time_pair(fns: dict, iters: int, rounds: int, sync) -> dict:
    """``{side: [µs of each call]}``: ``rounds`` blocks of ``iters`` calls per side, alternating which side goes
    first, after 3 calls of each side."""
    ts = {side: [] for side in fns}
    order = list(fns)
    for side in order:
        for _ in range(3):
            fns[side]()
    for r in range(rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            fn = fns[side]
            for _ in range(iters):
                sync()
                t0 = time.perf_counter()
                fn()
                ts[side].append((time.perf_counter() - t0) * 1e6)
    sync()
    return ts


def run_against(a, dev, other) -> list:
    """Both checkouts' calls of ``--calls`` in alternating blocks: a row per call (medians, ratio, minimums)."""
    libs = {"this": triton_ep, "other": other}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    built, calls, out = [], {}, []
    try:
        x, idx, w = inputs(a, dev)
        ll = any(c.startswith("ll_") for c in a.calls)
        for side, lib in libs.items():
            try:
                buf, llbuf, fns, _ = make_calls(lib, a, dev, x, idx, w, low_latency=ll)
            except Exception as ex:     # noqa: BLE001 - said in one line: the other checkout lacks a call
                raise SystemExit(f"host_cost.py --against: the {side} checkout's Buffer cannot make the calls "
                                 f"asked for ({type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}); "
                                 f"name fewer with --calls") from None
            built += [b for b in (buf, llbuf) if b is not None]
            calls[side] = fns
        for name in C.progress(a.calls, desc="host_cost --against"):
            ts = time_pair({side: calls[side][name] for side in libs}, a.iters, a.rounds, sync)
            med = {side: statistics.median(v) for side, v in ts.items()}
            out.append(dict(call=name, this_us=med["this"], other_us=med["other"], ratio=med["this"] / med["other"],
                            this_us_min=min(ts["this"]), other_us_min=min(ts["other"])))
        return out
    finally:
        for b in built:
            b.destroy()


def report_against(a, dev, other, out: list) -> None:
    """The table of :func:`run_against`'s rows, and ``<out>/host_cost_ab.json``."""
    what = ("host µs of one call from Python on this machine, both checkouts in one process" if dev.type == "cuda" else
            "CPU: kernels run inside the call under the Triton interpreter; the times say nothing about a GPU")
    C.say(f"[host_cost --against] {C.device_name()}, 1 rank, {a.tokens} tokens x {a.hidden}, buffer: {a.buffer}, "
          f"top-{a.topk} of "
          f"{a.experts}; this checkout against {a.against}; medians of {a.rounds} blocks of {a.iters} calls a side; "
          f"{what}")
    C.print_table(["call", "this us", "other us", "ratio", "this min", "other min"],
                  [[r["call"], C.sig(r["this_us"]), C.sig(r["other_us"]), C.sig(r["ratio"], 3),
                    C.sig(r["this_us_min"]), C.sig(r["other_us_min"])] for r in out])
    os.makedirs(a.out, exist_ok=True)
    C.write_json(os.path.join(a.out, "host_cost_ab.json"),
                 dict(device=C.device_name(), ranks=1, tokens=a.tokens, hidden=a.hidden, buffer=a.buffer, experts=a.experts,
                      topk=a.topk, iters=a.iters, rounds=a.rounds, against=os.path.abspath(a.against), note=what,
                      this_code=code_of(triton_ep), other_code=code_of(other), results=out))


# ------------------------------------------------------------------ --diff: two result files side by side
def figures(doc: dict) -> Tuple[str, Dict[str, Tuple[float, str]]]:
    """``(kind, {name: (value, unit)})`` of one result file.

    Raises:
        ValueError: a JSON of no script ``--diff`` knows.
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


def diff(before: dict, after: dict) -> list:
    """Rows of the figures both files have, in the after file's order.

    Raises:
        ValueError: the files come from different scripts, or from none ``--diff`` knows.
    """
    kb, fb = figures(before)
    ka, fa = figures(after)
    if kb != ka:
        raise ValueError(f"the files come from different scripts ({kb}, {ka})")
    return [dict(what=name, unit=unit, before=fb[name][0], after=v, ratio=v / fb[name][0] if fb[name][0] else None)
            for name, (v, unit) in fa.items() if name in fb]


def run_diff(a) -> None:
    """``--diff BEFORE AFTER``: the table, ``<out>/<name>.json`` and ``<out>/<name>.png``."""
    docs = []
    for path in a.diff:
        with open(path) as f:
            docs.append(json.load(f))
    rows = diff(*docs)
    C.print_table(["figure", "unit", "before", "after", "ratio"],
                  [[r["what"], r["unit"], C.sig(r["before"], 4), C.sig(r["after"], 4), C.sig(r["ratio"], 3)]
                   for r in rows])
    C.write_json(os.path.join(a.out, a.name + ".json"),
                 dict(note="ratio = after / before (below 1: the after run was quicker)",
                      before=dict(path=a.diff[0], device=docs[0].get("device")),
                      after=dict(path=a.diff[1], device=docs[1].get("device")), rows=rows))
    C.bar_chart(os.path.join(a.out, a.name + ".png"), [r["what"] for r in rows],
                {"after / before": [r["ratio"] or 0.0 for r in rows]}, f"{a.name}: after / before", "ratio", hline=1.0)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.diff:
        run_diff(a)
        return 0
    other = load_other(a.against) if a.against else None
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        try:
            out = run_against(a, dev, other) if other is not None else run_one(a, dev)
        finally:
            dist.destroy_process_group()
    if other is not None:
        report_against(a, dev, other, out)
    else:
        report_one(a, dev, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
