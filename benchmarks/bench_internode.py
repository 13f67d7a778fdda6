"""Benchmark of internode normal mode's network leg over the emulated fabric's rate model.

Two hosts of one rank each, hidden 7168 bf16, top-8 of 256 experts, random routing, ``--tokens`` tokens per
rank (default 4096). Each rank sends the other host one record per token that has an expert there, in the
byte layout internode dispatch uses (``triton_ep.modes.internode.network_record_bytes``), and combine returns
one bf16 partial sum per such token; both go through the RDMA scheduler (the proxy posts each chunk's WRITEs,
then its signal on the same QP), with each host's NIC a dual-port model (400 Gb/s ports) over 2 ECMP paths
of 400 Gb/s, as ``bench_scheduler.py``'s defaults. The ranks are threads of this process, so the fabric's
model sees all the traffic.

Reported per phase (dispatch, combine) and QP plan (the full plan of ``--qps`` QPs per peer over both ports,
and one QP per peer): the model bandwidth (bytes a rank sends over the model's makespan; the emulator's
virtual time, a model of NICs and fabric, not hardware) against the aggregate port rate of one NIC (both
ports, 100 GB/s), bytes per port and per QP, and the proxy's host microseconds per chunk (wall time of its
busy sweeps on this CPU, with the emulator copying payloads in the posting thread: an upper bound).

Then, **inside internode dispatch + combine** (``--inside-tokens``, default 512; 0 skips it): two processes
as two hosts of one rank on the emulated fabric without the rate model, ``Buffer.dispatch`` and
``Buffer.combine`` called ``--calls`` times after one warm-up call (the record kernels under Triton's
interpreter on CPU tensors, or on the GPU where there is one), and from ``Buffer.get_rdma_stats()`` the
proxy's busy seconds per chunk (all, and outside the transport's data posts, where the emulated fabric copies
the payloads: the proxy's own bookkeeping) and per MiB, the proxy's CPU µs per chunk (all; its own Python outside
transport calls, non-zero only with ``TRITON_EP_PROXY_CPU_SPLIT=1``; and with the thread proxy less the emulated
NIC's own CPU in its posts, ``emulated.nic_cpu_s()``: the figure a NIC would leave), the chunks and work requests per call, and the network leg's
seconds per call (kernels, proxy and waits: on a CPU the interpreter's kernels dominate it). With ``--worst``
the same again with ``num_worst_tokens`` (on a GPU the capture path: no host exchange per call), and on a GPU
one CUDA-graph replay of that dispatch + combine (wall time, two processes sharing the GPU: functional).

What this does not time: the forwarding leg over IPC on its own, and anything on a NIC.

    ./run.sh python benchmarks/bench_internode.py [--tokens 4096] [--qps 8] [--chunk-kib 1024]
        [--inside-tokens 512] [--calls 3] [--worst] [--out DIR]

A few minutes on two CPU cores at the defaults. Output: internode.json and two tables.
"""
from __future__ import annotations

import argparse
import os
import sys

from _common import ROOT, add_out_arg, check_shape_args, print_table, progress, say, write_json

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.cases.sched_helpers import Group, fabric, in_threads  # noqa: E402
from triton_ep.modes.internode import network_record_bytes  # noqa: E402
from triton_ep.scheduler import host_alltoall  # noqa: E402

NOTE = ("measured on this machine's CPU: bandwidths are the emulator's virtual time (a model of dual-port "
        "400 Gb/s NICs over 2 ECMP paths, not hardware); proxy us per chunk is host wall time of the proxy's busy "
        "sweeps, which include the emulator's payload copies")
PORT_GBPS, PORTS = 400.0, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--qps", type=int, default=8, help="QPs per peer of the full plan (default 8)")
    p.add_argument("--chunk-kib", type=int, default=1024, help="chunk (ring slot) KiB (default 1024)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--inside-tokens", type=int, default=512,
                   help="tokens per rank of the inside-internode runs (0: skip them; default 512)")
    p.add_argument("--calls", type=int, default=3, help="timed dispatch + combine calls inside internode (default 3)")
    p.add_argument("--worst", action="store_true",
                   help="also time num_worst_tokens dispatch + combine (on a GPU: the capture path, and one CUDA-graph "
                        "replay of them)")
    add_out_arg(p, "internode.json")
    a = p.parse_args(argv)
    if a.inside_tokens < 0:
        p.error("--inside-tokens must be >= 0")
    check_shape_args(p, a, ("tokens", "hidden", "experts", "topk", "qps", "chunk_kib", "slots", "calls"), 8,
                     "bf16 rows of whole 16 bytes")
    if a.experts % 2:
        p.error("--experts must be even (two hosts of one rank)")
    return a


def volumes(a) -> dict:
    """Bytes each rank sends the other host in dispatch and in combine (random routing, seeded)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for r in range(2):
        idx = torch.stack([torch.randperm(a.experts, generator=g)[:a.topk] for _ in range(a.tokens)])
        to_other = int(((idx // (a.experts // 2)) == 1 - r).any(1).sum())
        out[r] = {"tokens": to_other,
                  "dispatch": to_other * network_record_bytes(2 * a.hidden, 0, a.topk, True, 1),
                  "combine": to_other * network_record_bytes(2 * a.hidden + 4 * a.topk, 0, 0, False, 0)}
    return out


def run(a, qps: int, phase: str, vol: dict) -> dict:
    """One exchange of ``phase``'s bytes both ways on ``qps`` QPs per peer; the model's figures."""
    fab = fabric(2, port_gbps=PORT_GBPS, path_gbps=400.0, n_paths=2, ring_bytes=8 << 20)
    data = [np.random.default_rng(r).integers(0, 256, vol[r][phase], dtype=np.uint8) for r in range(2)]
    with Group(fab, 2, qps=qps, slots=a.slots, slot_bytes=a.chunk_kib << 10, timeout_s=300.0) as g:
        fab.model.reset()
        res = in_threads(lambda r: host_alltoall(g.scheds[r], {1 - r: data[r]}, {1 - r: data[1 - r].size}), 2,
                         timeout_s=900)
        for x in res:
            if isinstance(x, BaseException):
                raise x
        ok = all(np.array_equal(res[r][1 - r], data[1 - r]) for r in range(2))
        span = fab.model.makespan()
        st = g.scheds[0].stats()
        chunks = sum(q["chunks"] for q in st["qps"].values())
        busy = g.scheds[0].busy_s
    gbs = data[0].size / span / 1e9
    return {"phase": phase, "qps": qps, "bytes": int(data[0].size), "byte_exact": ok, "model_GBps": gbs,
            "fraction_of_ports": gbs / (PORTS * PORT_GBPS / 8), "bytes_per_port": st["ports"],
            "bytes_per_qp": {k: v["bytes"] for k, v in st["qps"].items()}, "chunks": chunks,
            "proxy_us_per_chunk": busy / max(chunks, 1) * 1e6}


def inside_rank(rank, world, a, worst: int = 0) -> dict:
    """One rank of the inside-internode runs: dispatch + combine ``a.calls`` times after a warm-up (with
    ``worst``: ``num_worst_tokens=worst``, on a GPU the capture path, then also captured in a CUDA graph and
    replayed ``a.calls`` times); the traffic counters' growth over the timed calls."""
    import time
    os.environ.update({"TRITON_EP_RANKS_PER_HOST": "1", "TRITON_EP_RDMA": "emulated",
                       "TRITON_EP_RDMA_QPS_PER_PEER": str(a.qps), "TRITON_EP_RDMA_SLOTS": str(a.slots),
                       "TRITON_EP_RDMA_CHUNK_BYTES": str(a.chunk_kib << 10)})
    import triton_ep
    from triton_ep.proxy_process import proxy_kind
    from triton_ep.transport import emulated
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(0)
    buf = triton_ep.Buffer(None, 256 << 20, timeout_s=600, device=dev)
    try:
        g = torch.Generator().manual_seed(rank)
        idx = torch.stack([torch.randperm(a.experts, generator=g)[:a.topk] for _ in range(a.inside_tokens)]).to(dev)
        w = torch.rand(a.inside_tokens, a.topk, generator=g).to(dev)
        x = torch.randn(a.inside_tokens, a.hidden, generator=g).to(torch.bfloat16).to(dev)
        layout = buf.get_dispatch_layout(idx, a.experts)

        def call():
            rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                                                   is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                                                   topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
            return buf.combine(rx, handle, topk_weights=rw)[0]

        def sync():
            if dev == "cuda":
                torch.cuda.synchronize()

        call()
        sync()
        nic0 = emulated.nic_cpu_s()
        s0, t0 = buf.get_rdma_stats(), time.perf_counter()
        for _ in range(a.calls):
            call()
        sync()
        wall, s1 = time.perf_counter() - t0, buf.get_rdma_stats()
        out = {k: s1[k] - s0[k] for k in ("chunks", "wrs", "proxy_busy_s", "proxy_post_s", "proxy_cpu_s",
                                          "proxy_transport_cpu_s", "network_s", "host_exchanges")} | {
            "wall_s": wall, "bytes": sum(s1["ports"].values()) - sum(s0["ports"].values()), "device": dev,
            # the emulated NIC's posts in this process: the proxy's (thread proxy) or none (process proxy)
            "nic_cpu_s": emulated.nic_cpu_s() - nic0 if proxy_kind() == "thread" else None}
        if worst and dev == "cuda":
            out["graph_replay_ms"] = graph_replay_ms(call, a.calls)
        return out
    finally:
        buf.destroy()


def graph_replay_ms(call, calls: int) -> float:
    """Milliseconds per replay of ``call`` captured in a CUDA graph, over ``calls`` replays (every rank captures
    and replays with the others: barriers around the capture and after the timed replays)."""
    import time
    import torch.distributed as dist
    graph = torch.cuda.CUDAGraph()
    dist.barrier()
    with torch.cuda.graph(graph):
        call()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / calls * 1e3
    dist.barrier()
    return ms


def inside(a, worst: int = 0) -> dict:
    """The inside-internode runs (two processes); rank 0's and rank 1's figures per call."""
    from triton_ep.testing import RankFailure, run_ranks
    out = run_ranks(inside_rank, 2, a, worst, timeout_s=3600)
    bad = [o for o in out if isinstance(o, RankFailure)]
    if bad:
        raise RuntimeError("; ".join(map(str, bad)))
    per_rank = []
    for r, o in enumerate(out):
        n = a.calls
        per_rank.append({"rank": r, "device": o["device"], "chunks_per_call": o["chunks"] / n,
                         "wrs_per_call": o["wrs"] / n, "MiB_per_call": o["bytes"] / n / 2 ** 20,
                         "proxy_us_per_chunk": o["proxy_busy_s"] / max(o["chunks"], 1) * 1e6,
                         "proxy_us_per_chunk_outside_posts": (o["proxy_busy_s"] - o["proxy_post_s"])
                         / max(o["chunks"], 1) * 1e6,
                         "proxy_us_per_MiB": o["proxy_busy_s"] / max(o["bytes"] / 2 ** 20, 1e-9) * 1e6,
                         "proxy_ms_per_call": o["proxy_busy_s"] / n * 1e3,
                         "proxy_cpu_us_per_chunk": o["proxy_cpu_s"] / max(o["chunks"], 1) * 1e6,
                         "proxy_own_cpu_us_per_chunk": (o["proxy_cpu_s"] - o["proxy_transport_cpu_s"])
                         / max(o["chunks"], 1) * 1e6,
                         "proxy_cpu_us_per_chunk_less_nic": None if o["nic_cpu_s"] is None else
                         (o["proxy_cpu_s"] - o["nic_cpu_s"]) / max(o["chunks"], 1) * 1e6,
                         "network_ms_per_call": o["network_s"] / n * 1e3, "wall_ms_per_call": o["wall_s"] / n * 1e3,
                         "host_exchanges_per_call": o["host_exchanges"] / n,
                         "graph_replay_ms": o.get("graph_replay_ms")})
    return {"tokens": a.inside_tokens, "calls": a.calls, "chunk_bytes": a.chunk_kib << 10, "num_worst_tokens": worst,
            "per_rank": per_rank}


def main(argv=None):
    a = parse_args(argv)
    vol = volumes(a)
    say(f"[bench_internode] {a.tokens} tokens x {a.hidden} bf16, top-{a.topk} of {a.experts}, 2 hosts of 1 rank: "
        f"rank 0 sends {vol[0]['tokens']} tokens to host 1 ({vol[0]['dispatch'] / 1e6:.1f} MB dispatch, "
        f"{vol[0]['combine'] / 1e6:.1f} MB combine); {NOTE}")
    results = []
    cases = [(q, ph) for q in (a.qps, 1) for ph in ("dispatch", "combine")]
    for q, ph in progress(cases, desc="bench_internode"):
        results.append(run(a, q, ph, vol))
    rows = [[r["phase"], r["qps"], f"{r['model_GBps']:.1f}", f"{r['fraction_of_ports']:.2f}",
             " / ".join(str(v) for v in r["bytes_per_port"].values()), f"{r['proxy_us_per_chunk']:.1f}",
             r["byte_exact"]] for r in results]
    print_table(["phase", "QPs/peer", "model GB/s", "of 2 ports", "bytes per port", "proxy us/chunk", "exact"],
                rows)
    doc = {"note": NOTE, "args": vars(a), "volumes": vol, "results": results}
    if a.inside_tokens:
        say(f"[bench_internode] inside internode dispatch + combine: {a.inside_tokens} tokens per rank, {a.calls} "
            f"calls after a warm-up, 2 processes as 2 hosts (emulated fabric, no rate model)")
        doc["inside"] = inside(a)
        runs = [("plain", doc["inside"])]
        if a.worst:
            doc["inside_worst"] = inside(a, 2 * a.inside_tokens)
            runs.append(("num_worst_tokens", doc["inside_worst"]))
        say("[bench_internode] num_worst_tokens: on a GPU the capture path (no host exchange; 'graph ms' is one "
            "CUDA-graph replay of dispatch + combine); on a CPU the host path. Two processes share one GPU: "
            "functional timings, not speed")
        print_table(["call", "rank", "device", "chunks/call", "WRs/call", "MiB/call", "proxy us/chunk",
                     "outside posts", "CPU us/chunk", "own CPU", "CPU less NIC", "proxy us/MiB", "proxy ms/call",
                     "network ms/call", "wall ms/call", "host exch/call", "graph ms"],
                    [[name, r["rank"], r["device"], f"{r['chunks_per_call']:.1f}", f"{r['wrs_per_call']:.1f}",
                      f"{r['MiB_per_call']:.2f}", f"{r['proxy_us_per_chunk']:.1f}",
                      f"{r['proxy_us_per_chunk_outside_posts']:.1f}", f"{r['proxy_cpu_us_per_chunk']:.1f}",
                      f"{r['proxy_own_cpu_us_per_chunk']:.1f}",
                      "-" if r["proxy_cpu_us_per_chunk_less_nic"] is None else
                      f"{r['proxy_cpu_us_per_chunk_less_nic']:.1f}", f"{r['proxy_us_per_MiB']:.1f}",
                      f"{r['proxy_ms_per_call']:.2f}", f"{r['network_ms_per_call']:.1f}", f"{r['wall_ms_per_call']:.1f}",
                      f"{r['host_exchanges_per_call']:.1f}",
                      "-" if r["graph_replay_ms"] is None else f"{r['graph_replay_ms']:.2f}"]
                     for name, ins in runs for r in ins["per_rank"]])
    path = os.path.join(a.out, "internode.json")
    write_json(path, doc)


if __name__ == "__main__":
    main()
