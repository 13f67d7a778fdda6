"""Latency of each normal-mode call, timed the way DeepEP's figures were: layout, dispatch, cached dispatch
and combine at several token counts, with NCCL's ``all_to_all_single`` of the same rows as an in-run anchor.

    ./run.sh python benchmarks/bench_calls.py [--ranks 2] [--tokens 128,1024,4096] [--buffers hint,2e9] [--out DIR]
    ./run.sh torchrun --nproc-per-node 2 benchmarks/bench_calls.py

``worst`` is a dispatch with ``num_worst_tokens`` = tokens x ranks (its counts stay on the device). Per
call: ``dist.barrier()`` and a device synchronise, CUDA events around the one call, the median of
``--iters`` calls, the slowest rank's median. Bandwidth is DeepEP's measure: the bf16 rows a rank receives
(dispatch) or sends back (combine) over that time. Host microseconds per call are the host time of the same
call when the previous one has finished (``perf_counter`` around the call, no synchronise inside): the
launch and argument work, which bounds small calls from below.

Shapes: hidden 7168 bf16, top-8 of 256 experts, uniform random routing (DeepEP's benchmark); ``--buffers``
``hint`` is the size frameworks pass (``Config.get_nvl_buffer_size_hint``), ``2e9`` a buffer that holds
every transfer in one round. On CPU (tiny shapes, kernels under the Triton interpreter) the figures only
show the script runs. Output: a table on rank 0's stdout and ``<out>/calls.json`` (``ranks``,
``ranks_per_gpu``, ``tokens``, µs per call); ``calls.png`` where matplotlib is installed.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (puts the repository root on sys.path, sets the NVLS switches off)

import _launch  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CALLS = ("layout", "dispatch", "worst", "cached", "combine", "a2a_dispatch", "a2a_combine")


def parse_args(argv=None) -> argparse.Namespace:
    """Command line; defaults are DeepEP's shapes on a GPU and tiny ones on CPU."""
    gpu = C.on_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=max(torch.cuda.device_count(), 1) if gpu else 2)
    p.add_argument("--tokens", default="128,1024,4096" if gpu else "16,48")
    p.add_argument("--hidden", type=int, default=7168 if gpu else 256)
    p.add_argument("--experts", type=int, default=256 if gpu else 16)
    p.add_argument("--topk", type=int, default=8 if gpu else 4)
    p.add_argument("--buffers", default="hint,2e9" if gpu else "hint",
                   help="comma-separated buffer sizes: 'hint' (DeepEP's size hint) or bytes such as 2e9")
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped")
    C.add_out_arg(p, "calls.json and calls.png")
    return p.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, iters: int, warmup: int, device) -> tuple:
    """(median device-or-wall µs, median host µs) of ``fn()``, every call started together after a barrier."""
    times, host = [], []
    for i in range(warmup + iters):
        _sync(device)
        dist.barrier()
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            e1.record()
            _sync(device)
            t = e0.elapsed_time(e1) * 1e3
        else:
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            t = (h1 - h0) * 1e6
        if i >= warmup:
            times.append(t)
            host.append((h1 - h0) * 1e6)
    return statistics.median(times), statistics.median(host)


def one_case(a, tokens: int, nbytes: int, device, rank: int, R: int) -> dict:
    """Every call of one (tokens, buffer) case on this rank: medians in µs and received bytes."""
    import triton_ep
    gen = torch.Generator().manual_seed(1000 * rank + tokens)
    x = C.random_rows(tokens, a.hidden, gen, device)
    idx = C.random_topk(tokens, a.topk, a.experts, gen, device)
    w = torch.rand(idx.shape, generator=gen).to(device)
    buf = triton_ep.Buffer(dist.group.WORLD, nbytes, device=device)
    lay = buf.get_dispatch_layout(idx, a.experts)
    per_rank, _, per_expert, in_rank, _ = lay

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    first = dispatch()
    recv_x, handle = first[0], first[4]
    out = {}
    def worst():         # num_worst_tokens: the counts stay on the device (no host wait)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                            num_worst_tokens=tokens * R)

    for name, fn in (("layout", lambda: buf.get_dispatch_layout(idx, a.experts)), ("dispatch", dispatch),
                     ("worst", worst),
                     ("cached", lambda: buf.dispatch(x, handle=handle)), ("combine", lambda: buf.combine(recv_x, handle))):
        out[name], out[name + "_host"] = time_call(fn, a.iters, a.warmup, device)
    # NCCL anchor: the same rows, packed beforehand, through all_to_all_single (both directions)
    if dist.get_backend() == "nccl":
        counts = [None] * R
        dist.all_gather_object(counts, in_rank.sum(0).tolist())
        send_splits, recv_splits = counts[rank], [counts[i][rank] for i in range(R)]
        order = torch.cat([in_rank[:, r].nonzero().flatten() for r in range(R)])
        packed = x.index_select(0, order)
        got = torch.empty((sum(recv_splits), a.hidden), dtype=x.dtype, device=device)
        back = torch.empty((sum(send_splits), a.hidden), dtype=x.dtype, device=device)
        out["a2a_dispatch"], _ = time_call(lambda: dist.all_to_all_single(got, packed, recv_splits, send_splits),
                                           a.iters, a.warmup, device)
        out["a2a_combine"], _ = time_call(lambda: dist.all_to_all_single(back, recv_x, send_splits, recv_splits),
                                          a.iters, a.warmup, device)
    buf.check()
    buf.destroy()
    out["recv_bytes"] = int(recv_x.shape[0]) * a.hidden * 2
    return out


def init_rank(a) -> tuple:
    """Join the launched group: ``(rank, R, device, ranks sharing a GPU, backend)``; one GPU per rank over
    NCCL, else gloo (ranks sharing a GPU, or CPU)."""
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = C.on_gpu()
    ngpu = torch.cuda.device_count() if gpu else 0
    device = torch.device("cuda", rank % ngpu) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    sharing = -(-R // ngpu) if gpu else R
    backend = "nccl" if gpu and sharing == 1 else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=a.timeout))
    return rank, R, device, sharing, backend


def rank_main(a) -> int:
    rank, R, device, sharing, backend = init_rank(a)
    results = []
    cases = [(int(t), b) for t in a.tokens.split(",") for b in a.buffers.split(",")]
    for tokens, b in C.progress(cases, desc="bench_calls", disable=rank != 0):
        nbytes = C.nvl_bytes_hint(a.hidden, R) if b == "hint" else int(float(b))
        mine = one_case(a, tokens, nbytes, device, rank, R)
        every = [None] * R
        dist.all_gather_object(every, mine)
        row = dict(tokens=tokens, buffer=b, buffer_bytes=nbytes)
        for k in mine:
            vals = [e[k] for e in every if k in e]
            row[k] = max(vals) if vals else None            # the slowest rank
        for k in ("dispatch", "cached", "combine"):
            row[k + "_GBps"] = C.gbps(row["recv_bytes"], row[k] / 1e3) if row.get(k) else None
        results.append(row)
    if rank == 0:
        report(a, results, R, sharing, backend)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(a, results, R, sharing, backend) -> None:
    gpu = C.on_gpu()
    what = ("GPU: CUDA-event µs of one call, slowest rank's median" if gpu and sharing == 1 else
            f"{R} ranks share {'each GPU' if gpu else 'this CPU'}: functional figures, not speed")
    C.say(f"[bench_calls] {C.device_name()}, {R} ranks ({backend}), hidden {a.hidden}, top-{a.topk} of "
          f"{a.experts}; {what}")
    heads = ["T", "buffer"] + [c + " us" for c in CALLS] + ["host us (l/d/w/c/cb)", "cached GB/s", "combine GB/s"]
    rows = []
    for r in results:
        host = "/".join(f"{r[c + '_host']:.0f}" for c in ("layout", "dispatch", "worst", "cached", "combine"))
        rows.append([r["tokens"], r["buffer"]] + [C.sig(r.get(c), 4) for c in CALLS] +
                    [host, C.sig(r["cached_GBps"]), C.sig(r["combine_GBps"])])
    C.print_table(heads, rows)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "calls.json")
    C.write_json(path, dict(device=C.device_name(), ranks=R, ranks_per_gpu=sharing if gpu else None,
                            backend=backend, hidden=a.hidden, experts=a.experts, topk=a.topk, iters=a.iters,
                            note=what, results=results))
    labels = [f"T{r['tokens']} {r['buffer']}" for r in results]
    C.bar_chart(os.path.join(a.out, "calls.png"), labels,
                {c: [r.get(c) or 0 for r in results] for c in ("layout", "dispatch", "worst", "cached", "combine")},
                f"triton-ep calls, {R} ranks, {C.device_name()}", "µs per call (slowest rank)")
    C.say(f"[bench_calls] wrote {path}")


def main(argv=None) -> int:
    a = parse_args(argv)
    return _launch.run(functools.partial(rank_main, a), a.ranks, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
