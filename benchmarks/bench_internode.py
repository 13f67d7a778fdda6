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

What this does not time: packing and unpacking the records on the host (the host-driven version of the
mode), the forwarding leg over IPC, and anything on a NIC.

    ./run.sh python benchmarks/bench_internode.py [--tokens 4096] [--qps 8] [--chunk-kib 1024] [--out DIR]

About a minute on two CPU cores at the defaults. Output: internode.json and a table.
"""
from __future__ import annotations

import argparse
import os
import sys

from _common import ROOT, add_out_arg, print_table, progress, say, write_json

sys.path.insert(0, os.path.join(ROOT, "tests"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sched_helpers import Group, fabric, in_threads  # noqa: E402
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
    add_out_arg(p, "internode.json")
    a = p.parse_args(argv)
    for name in ("tokens", "hidden", "experts", "topk", "qps", "chunk_kib", "slots"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
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
    path = os.path.join(a.out, "internode.json")
    write_json(path, {"note": NOTE, "args": vars(a), "volumes": vol, "results": results})


if __name__ == "__main__":
    main()
