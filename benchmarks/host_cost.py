"""Host cost of each normal-mode call on one rank alone: the microseconds Python spends in a call (argument
checks, allocations, kernel launches, the plain dispatch's one host wait), and the kernel launches it makes.

    ./run.sh python benchmarks/host_cost.py [--tokens 128] [--iters 30] [--cprofile] [--out DIR]

One rank (a gloo group of one), hidden 7168 bf16, top-8 of 256 experts on a GPU (tiny shapes on CPU),
random routing, a buffer holding every transfer in one round. Per call: a device synchronise, then
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
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

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


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128 if gpu else 16)
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--experts", type=int, default=256 if gpu else 16)
    p.add_argument("--topk", type=int, default=8 if gpu else 4)
    p.add_argument("--iters", type=int, default=30 if gpu else 5)
    p.add_argument("--cprofile", action="store_true", help="also print the top of a cProfile of each call")
    C.add_out_arg(p, "host_cost.json")
    a = p.parse_args(argv)
    C.check_shape_args(p, a, ("tokens", "hidden", "experts", "topk", "iters"), 128, "low-latency mode's rows")
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
    """Buffers of the package ``lib`` (``triton_ep``, or another copy of it: ``host_cost_ab.py``) on the default
    group: a normal one holding every transfer in one round and, with ``low_latency``, a low-latency one (N =
    tokens). Returns ``(buffer, low_latency_buffer or None, calls, dispatch_kwargs)``; ``calls``: name -> a
    function making that call once (dispatches take the layout ``get_dispatch_layout`` returned, so they launch
    none of their own; ``ll_*`` only with ``low_latency``)."""
    made = []                   # destroyed again if a later step fails (the caller gets nothing to destroy)
    try:
        buf = lib.Buffer(dist.group.WORLD, max(1 << 22, a.tokens * (a.hidden * 2 + 512) * 2), device=dev)
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


def main(argv=None) -> int:
    a = parse_args(argv)
    import triton_ep
    dev = torch.device("cuda") if C.on_gpu() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdv", rank=0, world_size=1)
        try:
            x, idx, w = inputs(a, dev)
            buf, llbuf, calls, kw = make_calls(triton_ep, a, dev, x, idx, w)
            if dev.type == "cuda":
                calls.update(floor_calls(dev))
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            counter = count_launches() if dev.type != "cuda" else None
            out = []
            def fresh_layout():
                """As a caller does: dispatch with the layout just computed for its topk_idx (the Buffer then
                launches no layout of its own)."""
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, a.experts)
                kw.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

            for name, fn in C.progress(list(calls.items()), desc="host_cost"):
                if name == "dispatch":
                    fresh_layout()
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
                med, lo = statistics.median(ts), min(ts)
                row = dict(call=name, host_us=med, host_us_min=lo, launches=launches)
                if dev.type == "cuda" and not name.startswith("floor"):
                    row.update(launch_us=time_inside(fn, a.iters, sync, LAUNCHES),
                               alloc_us=time_inside(fn, a.iters, sync, ALLOCATORS))
                out.append(row)
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
            if counter is None:
                # after every timing: CUPTI, once a profiler attached it, may slow later launches down
                for row in out:
                    if row["call"] == "dispatch":
                        fresh_layout()
                    row["launches"] = gpu_kernels(calls[row["call"]])
            rows = [[r["call"], C.sig(r["host_us"]), C.sig(r["host_us_min"]), C.sig(r.get("launch_us")),
                     C.sig(r.get("alloc_us")),
                     sum(r["launches"].values()), ", ".join(f"{k} {v}" for k, v in r["launches"].items())]
                    for r in out]
            llbuf.destroy()
            buf.destroy()
        finally:
            dist.destroy_process_group()
    what = ("host µs of one call from Python on this machine (GPU: the call only enqueues work, except a plain "
            "dispatch's host wait)" if dev.type == "cuda" else
            "CPU: kernels run inside the call under the Triton interpreter; the times say nothing about a GPU")
    C.say(f"[host_cost] {C.device_name()}, 1 rank, {a.tokens} tokens x {a.hidden}, top-{a.topk} of {a.experts}; {what}")
    C.print_table(["call", "host us (median)", "min", "in launches us", "in allocations us",
                   "kernels" if dev.type == "cuda" else "launcher calls", "per kernel"], rows)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "host_cost.json")
    C.write_json(path, dict(device=C.device_name(), ranks=1, ranks_per_gpu=1, tokens=a.tokens, hidden=a.hidden,
                            experts=a.experts, topk=a.topk, iters=a.iters, note=what, results=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
