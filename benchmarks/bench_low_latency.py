"""Latency of the low-latency calls (decode-time dispatch and combine), timed the way DeepEP's figures were,
with a same-run anchor built from ``torch.distributed.all_to_all_single`` plus permutes.

    ./run.sh python benchmarks/bench_low_latency.py [--ranks 2] [--tokens 128] [--out DIR]

Shapes (DeepEP's low-latency benchmark): 128 tokens per rank, hidden 7168, top-8 of 256 experts, uniform
random routing. Per call: ``dist.barrier()`` and a device synchronise, CUDA events around the one call,
the median of ``--iters`` calls, the slowest rank's median (``dispatch`` FP8, ``dispatch_bf16``,
``combine``). Host µs: ``perf_counter`` around the same call (launches and argument checks). ``graph``:
dispatch (FP8) + combine captured in one CUDA graph, GPU µs per replay (CUDA events around 20 replays,
median), no host work at all. ``a2a_*`` (NCCL only, one rank per GPU): the same (token, expert) rows
packed with ``index_select``, moved by ``all_to_all_single`` and put in expert order (dispatch), and back
with the weighted sum by ``index_add_`` (combine). With several ranks on one GPU (gloo) or on CPU the
figures only show the script runs. Output: a table on rank 0's stdout and ``<out>/low_latency.json``.

``--hosts H`` (H >= 2 dividing ``--ranks``) runs the ranks as H hosts on the emulated RDMA fabric
(``TRITON_EP_RANKS_PER_HOST``, ``TRITON_EP_RDMA=emulated``): internode low-latency mode, every peer over the
RDMA scheduler. It adds ``network``: over ``--net-calls`` FP8 dispatch + combine pairs after the timed calls,
the work requests and chunks each low-latency call posts (per rank), the proxy's host µs per call and per work
request (``proxy_busy_s`` of ``Buffer.get_rdma_stats()["low_latency"]``: its sweeps that moved something; over
the emulated fabric that includes the emulator's payload copies, reported apart as ``proxy_post_us_per_call``,
the rest as ``proxy_other_us_per_call``; ``proxy_transport_us_per_call``: inside any transport call (polls,
posts, credits: the emulator's Python over the emulated fabric, pyverbs calls on a NIC), and
``proxy_own_us_per_call`` the rest, the scheduler's own Python (wall clock: with any wait for the GIL that falls
in it); ``proxy_cpu_us_per_call``: the proxy thread's CPU time in those sweeps, without its waits for the GIL, and
``proxy_own_cpu_us_per_call`` the part of it outside transport calls: the scheduler's own Python in CPU time),
the bytes per port and their spread (max / min - 1) and the bytes per QP. The call timings there are functional.
``--logfmt`` adds ``combine_logfmt`` (``low_latency_combine(use_logfmt=True)`` of the same rows, timed as
``combine``) and ``graph_logfmt`` (FP8 dispatch + LogFMT combine per graph replay), and a line comparing it with the
bf16 combine: bytes a returned row takes in the receiver's area (``logfmt_row_bytes`` against ``2 * hidden``;
DeepEP's LogFMT-10 size ``hidden * 10 / 8 + hidden / 128 * 4`` beside it), the selections (rows) each rank
returns, and the bandwidth DeepEP's way (those bytes over the combine's time); with ``--hosts``, also the bytes the
network leg posted per combine of each kind (``get_rdma_stats()``, over ``--net-calls`` combines).
``--arrival-words`` (with ``--hosts``) sets ``TRITON_EP_LL_ARRIVAL_WORDS=1``: each chunk is signalled by an arrival
word the receiving kernel polls instead of a WRITE_WITH_IMM the receiving proxy turns into the tail
(``network.arrival_words`` says which ran).
``--busy-main`` (GPU) adds ``graph_one_idle`` / ``graph_one_busy``: CUDA events around one replay of that graph,
the main thread idle (the end event's synchronise) or running plain Python until ``end.query()`` is true, as a
serving engine's scheduler does while a decode step's graph runs; with ``--hosts``, run it once per
``TRITON_EP_PROXY`` (a proxy thread waits for the GIL, a proxy process does not).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from typing import Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import _launch  # noqa: E402
from bench_calls import init_rank, time_call  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from triton_ep.proxy_process import proxy_kind  # noqa: E402

CALLS = ("dispatch", "dispatch_bf16", "combine", "graph", "a2a_dispatch", "a2a_combine")


def parse_args(argv=None) -> argparse.Namespace:
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=max(torch.cuda.device_count(), 1) if gpu else 2)
    p.add_argument("--tokens", type=int, default=128 if gpu else 8, help="tokens per rank (= N)")
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--experts", type=int, default=256 if gpu else 8)
    p.add_argument("--topk", type=int, default=8 if gpu else 2)
    p.add_argument("--iters", type=int, default=20 if gpu else 2)
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped")
    p.add_argument("--profile", action="store_true",
                   help="on a GPU, also list each kernel's µs per graph replay of dispatch + combine (rank 0)")
    p.add_argument("--sweep", action="store_true",
                   help="on a GPU, also sweep the low-latency kernels' launch shapes (one parameter at a time, "
                        "each kept where its kernel's µs per graph replay is least; rank 0's kernels, results "
                        "checked bit for bit against the starting shapes) and write low_latency_sweep.json")
    p.add_argument("--hosts", type=int, default=1,
                   help="run the ranks as this many hosts over the emulated RDMA fabric (internode low-latency mode)")
    p.add_argument("--net-calls", type=int, default=20, help="with --hosts: dispatch + combine pairs counted")
    p.add_argument("--arrival-words", action="store_true",
                   help="with --hosts: signal chunks by arrival words the receive polls (TRITON_EP_LL_ARRIVAL_WORDS=1)")
    p.add_argument("--logfmt", action="store_true",
                   help="also time the combine with use_logfmt=True against the bf16 one (bytes per row and time)")
    p.add_argument("--busy-main", action="store_true",
                   help="on a GPU, also time one replay of the dispatch + combine graph while the main thread runs "
                        "plain Python until the replay's end event is done, against an idle main thread "
                        "(graph_one_idle, graph_one_busy; with --hosts, TRITON_EP_PROXY says where the proxy runs)")
    C.add_out_arg(p, "low_latency.json")
    a = p.parse_args(argv)
    check_args(p, a)
    return a


def check_args(p, a) -> None:
    """Argument errors of parser ``p`` (exit status 2, one line, before any rank starts): the shared checks
    (``_common.check_shape_args``: counts of at least 1, ``--warmup`` at least 0, ``--timeout`` above 0, ``--topk``
    at most ``--experts``, ``--experts`` a multiple of ``--ranks``, ``--out`` a folder this process can write in),
    ``--hidden`` a multiple of 128 (the FP8 dispatch's blocks), ``--hosts`` dividing ``--ranks``, ``--arrival-words``
    only with ``--hosts`` 2 or more, ``--sweep`` only at ``--ranks`` 1."""
    C.check_shape_args(p, a, ("ranks", "tokens", "hidden", "experts", "topk", "iters", "hosts", "net_calls"), 128,
                       "the FP8 dispatch casts blocks of 128 channels")
    if a.ranks % a.hosts:
        p.error(f"--hosts {a.hosts} must divide --ranks {a.ranks}")
    if a.arrival_words and a.hosts < 2:
        p.error("--arrival-words needs --hosts 2 or more (it changes the network leg between hosts)")
    if a.sweep and a.ranks != 1:
        p.error("--sweep runs at --ranks 1 (each rank would choose its own shapes)")


def _captured(fn, device) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph (the device synchronised before and after)."""
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize(device)
    return g


def _graph_us(g, device) -> float:
    """GPU µs per replay of the CUDA graph ``g`` (median over 5 x 20 replays)."""
    ts = []
    for _ in range(5):
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            g.replay()
        e1.record()
        torch.cuda.synchronize(device)
        ts.append(e0.elapsed_time(e1) * 1e3 / 20)
    return statistics.median(ts)


def _graph_busy_us(g, device, samples: int = 20) -> Tuple[float, float]:
    """GPU µs of one replay of ``g`` (CUDA events around it, median of ``samples``, a barrier before each) while
    this process's main thread waits for its end event idle (``idle``: the event's synchronise, which lets the GIL
    go) and while it runs plain Python until ``end.query()`` is true (``busy``: what a serving engine's scheduler
    does while a decode step's graph runs; a proxy thread then waits for the GIL): ``(idle, busy)``."""
    def one(busy: bool) -> float:
        dist.barrier()
        torch.cuda.synchronize(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        if busy:
            n = 0
            while not e1.query():
                n += 1
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e3

    one(False), one(True)
    return (statistics.median(one(False) for _ in range(samples)),
            statistics.median(one(True) for _ in range(samples)))


def _kernel_us(g, device, replays: int = 20) -> dict:
    """GPU µs per replay of each kernel of the CUDA graph ``g`` (``torch.profiler`` over ``replays``
    replays): kernel name -> [launches per replay, µs per replay]."""
    from torch.profiler import ProfilerActivity, profile
    g.replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize(device)
    rows = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.count and us:
            rows[e.key[:60]] = [e.count / replays, us / replays]
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1]))


#: the swept launch parameters (triton_ep.kernels._util.GPU_TUNING's low-latency entries) and their kernels
SWEEP = {
    "ll_route": ("_ll_route_kernel", dict(block_t=[32, 64, 128], experts=[1, 2, 4], num_warps=[1, 2, 4, 8])),
    "ll_send": ("_ll_dispatch_send_kernel", dict(block_h=[512, 1024], block_t=[1, 2], num_warps=[2, 4, 8])),
    "ll_recv": ("_ll_dispatch_recv_kernel", dict(block_r=[4, 8, 16], programs_per_expert=[1, 2],
                                                 expert_programs=[0, 128], block_w=[512, 1024, 2048],
                                                 num_warps=[2, 4, 8])),
    "ll_combine_send": ("_ll_combine_send_kernel", dict(programs_per_expert=[1, 2, 4, 8], block_r=[1, 2, 4, 8],
                                                        block_w=[1024, 2048, 4096], num_warps=[2, 4, 8])),
    "ll_reduce": ("_ll_combine_reduce_kernel", dict(block_h=[512, 1024], block_t=[1, 2], num_warps=[1, 2, 4])),
}


def _sweep(dispatch, combine, device) -> dict:
    """Coordinate descent over :data:`SWEEP` on dispatch (FP8) + combine in a CUDA graph: for each kernel
    and parameter, every value is tried with the others held, and the one giving that kernel the fewest
    µs per replay is kept. Every variant's outputs must equal the starting shapes' bit for bit (the
    received rows and scales up to each expert's count, the counts, the combined tokens). Returns the
    chosen shapes, the µs before and after, and every trial."""
    from triton_ep.kernels._util import GPU_TUNING

    def measure():
        res = {}

        def both():
            (q, sc), cnt, h, _, _ = dispatch()
            res["d"] = (q, sc, cnt, h[0])
            res["c"] = combine()[0]
        g = _captured(both, device)
        g.replay()
        torch.cuda.synchronize(device)
        q, sc, cnt, src = res["d"]
        rows = torch.arange(q.shape[1], device=device)[None, :] < cnt[:, None].long()
        got = (q.view(torch.uint8)[rows].clone(), sc[rows].clone(), cnt.clone(), src[rows].clone(), res["c"].clone())
        us = {k: v[1] for k, v in _kernel_us(g, device).items()}
        total = _graph_us(g, device)
        del g
        return got, us, total

    ref, us0, total0 = measure()
    trials = []
    for tune, (kernel, params) in SWEEP.items():
        for p, values in params.items():
            best_v = GPU_TUNING[tune][p]
            best = measure()[1].get(kernel, float("inf"))
            for v in values:
                if v == best_v:
                    continue
                GPU_TUNING[tune][p] = v
                got, us, total = measure()
                same = all(torch.equal(a_, b_) for a_, b_ in zip(got, ref))
                trials.append(dict(kernel=tune, param=p, value=v, us=us.get(kernel), graph_us=total, same=same))
                C.say(f"[sweep] {tune}.{p}={v}: {us.get(kernel, float('nan')):.1f} us (best {best:.1f} at {best_v}), "
                      f"graph {total:.1f} us{'' if same else ', RESULTS DIFFER'}")
                if not same:
                    raise AssertionError(f"{tune}.{p}={v} changed the results")
                if us.get(kernel, float("inf")) < best:
                    best_v, best = v, us[kernel]
                GPU_TUNING[tune][p] = best_v
    _, us1, total1 = measure()
    return dict(chosen={k: dict(GPU_TUNING[k]) for k in SWEEP}, kernels_before=us0, graph_before=total0,
                kernels_after=us1, graph_after=total1, trials=trials)


def one_run(a, device, rank: int, R: int) -> dict:
    import triton_ep
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    El = E // R
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    x = C.random_rows(T, H, gen, device)
    idx = C.random_topk(T, K, E, gen, device)
    w = torch.rand(idx.shape, generator=gen).to(device)
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = triton_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=El, device=device)
    out = {}
    first = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    recv_bf16, handle = first[0], first[2]

    def dispatch():
        return buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)

    def combine():
        return buf.low_latency_combine(recv_bf16, idx, w, handle)

    for name, fn in (("dispatch", dispatch), ("dispatch_bf16", lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)),
                     ("combine", combine)):
        out[name], out[name + "_host"] = time_call(fn, a.iters, a.warmup, device)
    if device.type == "cuda":
        graph = _captured(lambda: (dispatch(), combine()), device)
        out["graph"] = _graph_us(graph, device)
        if a.busy_main:
            out["graph_one_idle"], out["graph_one_busy"] = _graph_busy_us(graph, device, a.iters)
        if a.profile and rank == 0:
            out["kernels"] = _kernel_us(graph, device)
        if a.sweep:
            del graph
            out["sweep"] = _sweep(dispatch, combine, device)
    if dist.get_backend() == "nccl":
        out.update(_a2a_anchor(a, x, idx, w, rank, R, device))
    if a.logfmt:
        out.update(_logfmt(a, buf, dispatch, combine, recv_bf16, idx, w, handle, device))
    if a.hosts > 1:
        out["network"] = _network(buf, dispatch, combine, a.net_calls)
    buf.check()
    buf.destroy()
    return out


def _a2a_anchor(a, x, idx, w, rank: int, R: int, device) -> dict:
    """The anchor (NCCL only): the same (token, expert) rows through ``all_to_all_single``, with the permutes around
    it, timed as the dispatch and the combine (``a2a_dispatch``, ``a2a_combine``)."""
    T, H, K, El = a.tokens, a.hidden, a.topk, a.experts // R
    valid = idx >= 0
    dst = torch.where(valid, idx // El, R)
    flat = dst.flatten()
    order = torch.argsort(flat, stable=True)[: int(valid.sum())]
    send = torch.bincount(flat[order], minlength=R)[:R].tolist()
    every = [None] * R
    dist.all_gather_object(every, send)
    recv = [every[i][rank] for i in range(R)]
    got = torch.empty((sum(recv), H), dtype=x.dtype, device=device)
    tok = order // K
    perm = torch.randperm(max(sum(recv), 1), device=device)[: sum(recv)]     # stands for the expert sort
    back = torch.empty((len(tok), H), dtype=x.dtype, device=device)
    wt = w.flatten()[order].unsqueeze(1)

    def a2a_dispatch():
        dist.all_to_all_single(got, x.index_select(0, tok), recv, send)
        return got.index_select(0, perm)

    def a2a_combine():
        dist.all_to_all_single(back, got.index_select(0, perm), send, recv)
        res = torch.zeros((T, H), dtype=torch.float32, device=device)
        res.index_add_(0, tok, back.float() * wt)
        return res.to(torch.bfloat16)

    return {"a2a_dispatch": time_call(a2a_dispatch, a.iters, a.warmup, device)[0],
            "a2a_combine": time_call(a2a_combine, a.iters, a.warmup, device)[0]}


def _logfmt(a, buf, dispatch, combine, rows, idx, w, handle, device) -> dict:
    """``--logfmt``: the LogFMT combine of the same rows timed as ``combine`` (and in a graph after an FP8 dispatch),
    the bytes a row takes (area stride, DeepEP's LogFMT-10 size, bf16), the selections this rank returns, and with
    ``--hosts`` the network leg's bytes per combine of each kind."""
    H = a.hidden

    def combine_logfmt():
        return buf.low_latency_combine(rows, idx, w, handle, use_logfmt=True)

    res = {}
    res["combine_logfmt"], res["combine_logfmt_host"] = time_call(combine_logfmt, a.iters, a.warmup, device)
    if device.type == "cuda":
        graph = _captured(lambda: (dispatch(), combine_logfmt()), device)
        res["graph_logfmt"] = _graph_us(graph, device)
        del graph
    lay = buf._ll.layout(a.tokens, H, a.experts)
    res["logfmt_row_bytes"] = 4 * lay.logfmt_row_words
    res["selections"] = int((handle[1] & 0xFFFFFFFF).sum())      # rows this rank returns (its received rows)
    if a.hosts > 1:
        def posted(fn) -> float:
            b0 = sum(q["bytes"] for q in buf.get_rdma_stats()["low_latency"]["qps"].values())
            for _ in range(a.net_calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            return (sum(q["bytes"] for q in buf.get_rdma_stats()["low_latency"]["qps"].values()) - b0) / a.net_calls
        res["net_bytes_bf16"], res["net_bytes_logfmt"] = posted(combine), posted(combine_logfmt)
    return res


def _network(buf, dispatch, combine, calls: int) -> dict:
    """The low-latency network leg's counters over ``calls`` dispatch + combine pairs (``--hosts``)."""
    def snap():
        return buf.get_rdma_stats()["low_latency"]
    s0 = snap()
    for _ in range(calls):
        dispatch()
        combine()
    if buf.device.type == "cuda":     # every rank's kernels done: every chunk was posted and placed
        torch.cuda.synchronize(buf.device)
    dist.barrier()
    buf.check()
    s1 = snap()
    n = 2 * calls
    wrs = s1["wrs"] - s0["wrs"]
    busy_us, post_us, tx_us, cpu_us, tx_cpu_us = ((s1[k] - s0[k]) * 1e6 for k in (
        "proxy_busy_s", "proxy_post_s", "proxy_transport_s", "proxy_cpu_s", "proxy_transport_cpu_s"))
    ports = {k: v - s0["ports"].get(k, 0) for k, v in s1["ports"].items()}
    qps = {k: v["bytes"] - s0["qps"].get(k, {"bytes": 0})["bytes"] for k, v in s1["qps"].items()}
    pv = [v for v in ports.values()]
    return dict(calls=n, arrival_words=buf._ll.net.arrival_words, wrs_per_call=wrs / n,
                chunks_per_call=(s1["chunks"] - s0["chunks"]) / n,
                proxy_us_per_call=busy_us / n, proxy_us_per_wr=busy_us / max(wrs, 1),
                proxy_post_us_per_call=post_us / n, proxy_other_us_per_call=(busy_us - post_us) / n,
                proxy_transport_us_per_call=tx_us / n, proxy_own_us_per_call=(busy_us - tx_us) / n,
                proxy_cpu_us_per_call=cpu_us / n, proxy_own_cpu_us_per_call=(cpu_us - tx_cpu_us) / n,
                proxy_busy_sweeps_per_call=(s1["proxy_busy_sweeps"] - s0["proxy_busy_sweeps"]) / n,
                port_bytes=ports, port_spread=(max(pv) / max(min(pv), 1) - 1) if pv else None, qp_bytes=qps)


def rank_main(a) -> int:
    rank, R, device, sharing, backend = init_rank(a)
    mine = None
    for _ in C.progress(range(1), desc="bench_low_latency", disable=rank != 0):
        mine = one_run(a, device, rank, R)
    every = [None] * R
    dist.all_gather_object(every, mine)
    kernels = mine.pop("kernels", None)
    sweep = mine.pop("sweep", None)
    for e in every:
        e.pop("sweep", None)
        e.pop("kernels", None)
    nets = [e.pop("network", None) for e in every]
    mine.pop("network", None)
    row = {k: max(e[k] for e in every if k in e) for k in mine}       # the slowest rank
    if nets[0] is not None:
        row["network"] = nets
    if rank == 0:
        report(a, row, R, sharing, backend, kernels)
        if sweep is not None:
            path = os.path.join(a.out, "low_latency_sweep.json")
            C.write_json(path, dict(device=C.device_name(), ranks=R, tokens=a.tokens, hidden=a.hidden,
                                    experts=a.experts, topk=a.topk, note="GPU us per graph replay of dispatch (FP8) + "
                                    "combine; per kernel by torch.profiler, rank 0", **sweep))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(a, row, R, sharing, backend, kernels=None) -> None:
    gpu = C.on_gpu()
    what = ("GPU: CUDA-event µs of one call, slowest rank's median; graph: GPU µs per replay of dispatch + combine"
            if gpu and sharing == 1 else
            f"{R} ranks share {'each GPU' if gpu else 'this CPU'}: functional figures, not speed" +
            ("" if gpu else f" ({C.CPU_NOTE})"))
    C.say(f"[bench_low_latency] {C.device_name()}, {R} ranks ({backend}), {a.tokens} tokens/rank, hidden {a.hidden}, "
          f"top-{a.topk} of {a.experts}; {what}")
    heads = [c + " us" for c in CALLS] + ["host us (d/d16/c)"]
    host = "/".join(f"{row[c + '_host']:.0f}" for c in ("dispatch", "dispatch_bf16", "combine"))
    C.print_table(heads, [[C.sig(row.get(c), 4) for c in CALLS] + [host]])
    for r, net in enumerate(row.get("network") or []):
        C.say(f"[bench_low_latency] rank {r}, network leg over {net['calls']} low-latency calls "
              f"({net['calls'] // 2} FP8 dispatches and {net['calls'] // 2} combines, --net-calls pairs; chunks signalled "
              f"by {'arrival words' if net['arrival_words'] else 'WRITE_WITH_IMM'}): "
              f"{net['wrs_per_call']:.1f} work requests and {net['chunks_per_call']:.1f} chunks a call, proxy "
              f"{net['proxy_us_per_call']:.0f} µs a call ({net['proxy_post_us_per_call']:.0f} of them in the transport's "
              f"posts: the emulator's copies; {net['proxy_transport_us_per_call']:.0f} in any transport call, "
              f"{net['proxy_own_us_per_call']:.0f} in the proxy's own Python; CPU "
              f"{net['proxy_cpu_us_per_call']:.0f}, of which {net['proxy_own_cpu_us_per_call']:.0f} own) over "
              f"{net['proxy_busy_sweeps_per_call']:.1f} sweeps that moved something, {net['proxy_us_per_wr']:.1f} µs a work request, port "
              f"spread {C.sig(net['port_spread'])}; bytes per port {net['port_bytes']}")
    if "combine_logfmt" in row:
        H = a.hidden
        deepep = H * 10 // 8 + H // 128 * 4
        sel = row["selections"]
        net = (f"; network leg per combine (slowest rank): {row['net_bytes_logfmt']:.0f} bytes LogFMT against "
               f"{row['net_bytes_bf16']:.0f} bf16" if "net_bytes_logfmt" in row else "")
        graphs = (f"; graph replay of FP8 dispatch + combine {C.sig(row.get('graph_logfmt'))} µs LogFMT against "
                  f"{C.sig(row.get('graph'))} bf16" if row.get("graph_logfmt") is not None else "")
        C.say(f"[bench_low_latency] LogFMT combine: {row['logfmt_row_bytes']} bytes a selection in the area (DeepEP's "
              f"LogFMT-10: {deepep}) against {2 * H} bf16; up to {sel} selections a rank; combine "
              f"{C.sig(row['combine_logfmt'])} µs LogFMT ({C.sig(C.gbps(sel * deepep, row['combine_logfmt'] / 1e3))} "
              f"GB/s DeepEP's way) against {C.sig(row['combine'])} µs bf16 "
              f"({C.sig(C.gbps(sel * 2 * H, row['combine'] / 1e3))} GB/s); host µs {row['combine_logfmt_host']:.0f} "
              f"against {row['combine_host']:.0f}{graphs}{net}")
    if "graph_one_busy" in row:
        C.say(f"[bench_low_latency] one graph replay of dispatch + combine (slowest rank's median, CUDA events), "
              f"RDMA proxy as a {proxy_kind()}: {C.sig(row['graph_one_busy'])} µs while the main thread runs plain "
              f"Python until the replay ends, {C.sig(row['graph_one_idle'])} µs with it idle: "
              f"{row['graph_one_busy'] / row['graph_one_idle']:.2f}x")
    if kernels:
        C.say("[bench_low_latency] rank 0's kernels per graph replay of dispatch + combine (torch.profiler):")
        C.print_table(["kernel", "launches", "GPU us"], [[k, f"{n:g}", f"{us:.1f}"] for k, (n, us) in kernels.items()])
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "low_latency.json")
    C.write_json(path, dict(device=C.device_name(), ranks=R, ranks_per_gpu=sharing if gpu else None, backend=backend,
                            tokens=a.tokens, hidden=a.hidden, experts=a.experts, topk=a.topk, iters=a.iters, note=what,
                            proxy=proxy_kind() if a.hosts > 1 else None, results=row, kernels_per_replay=kernels))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.hosts > 1:
        os.environ.update(TRITON_EP_RANKS_PER_HOST=str(a.ranks // a.hosts), TRITON_EP_RDMA="emulated")
        if a.arrival_words:
            os.environ["TRITON_EP_LL_ARRIVAL_WORDS"] = "1"
    return _launch.run(functools.partial(rank_main, a), a.ranks, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
