"""Benchmark of the RDMA scheduler (triton_ep/scheduler.py).

1. Model bandwidth (the emulated fabric's virtual time, a model result: it shows the scheduler's channel
   choice, not hardware): rank 0 sends ``--mib`` MiB to rank 1 through the scheduler, each host one
   dual-port NIC model (400 Gb/s ports) over 4 ECMP paths of 200 Gb/s; 1 channel on 1 QP against the full
   plan (``--qps`` QPs per peer over both ports, source ports spread by the QP plan).  Ratio target >= 1.9x.
   Bytes per port and per QP of the full plan (each port within 5% of even).
2. Proxy cost, timed against a null Transport (completions at once, no payload moved: the emulator copies
   payloads in the posting thread, so it would time itself): host us per work request and per chunk of
   ``--chunk-kib`` (target <= 20 us per 1 MiB chunk), WRs per second; again while the main thread holds
   the GIL launching kernels (Triton-interpreted launches on CPU, compiled ones on GPU).
3. A timeline of one all-to-all (2 hosts, full plan): Chrome-trace JSON (opens in Perfetto) and a PNG:
   producer chunks, posts per channel/QP, arrivals.

    ./run.sh python benchmarks/bench_scheduler.py [--mib 64] [--qps 8] [--chunks 4000] [--out DIR]

About 30 s on two CPU cores.  Outputs: scheduler.json, scheduler_trace.json, scheduler_trace.png.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from _common import ROOT, add_out_arg, progress, say, write_json

sys.path.insert(0, os.path.join(ROOT, "tests"))
import numpy as np  # noqa: E402

from sched_helpers import Group, fabric, in_threads  # noqa: E402
from triton_ep.scheduler import Scheduler, host_alltoall  # noqa: E402
from triton_ep.transport.null import NullTransport, NullWire  # noqa: E402

NOTE = ("measured on this machine's CPU: bandwidths are the emulator's virtual time (a model of the NICs and "
        "fabric, not hardware); proxy costs are host wall time of the proxy thread over a null transport "
        "(no verbs calls), so on real NICs add the cost of the verbs calls themselves")


def model_bandwidth(qps: int, mib: int, chunk: int, slots: int) -> dict:
    """Send ``mib`` MiB 0 -> 1 through the scheduler on ``qps`` QPs; the model's GB/s and byte spread."""
    fab = fabric(2, port_gbps=400.0, path_gbps=200.0, ring_bytes=4 << 20)
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    with Group(fab, 2, qps=qps, slots=slots, slot_bytes=chunk, timeout_s=120.0) as g:
        fab.model.reset()
        res = in_threads(lambda r: host_alltoall(g.scheds[r], {1: data} if r == 0 else {},
                                                 {} if r == 0 else {0: data.size}), 2, timeout_s=600)
        for x in res:
            if isinstance(x, BaseException):
                raise x
        assert np.array_equal(res[1][0], data)
        st = g.scheds[0].stats()
        span = fab.model.makespan()
    ports = st["ports"]
    even = sum(ports.values()) / len(ports)
    return {"qps": qps, "GBps": data.size / span / 1e9, "bytes_per_port": ports,
            "port_max_dev_from_even": max(abs(v - even) / even for v in ports.values()),
            "bytes_per_qp": {k: v["bytes"] for k, v in st["qps"].items()},
            "channel_port_per_qp": {k: [v["channel"], v["port"]] for k, v in st["qps"].items()}}


def busy_launcher(stop: threading.Event) -> None:
    """Hold the GIL as a training loop's main thread does: launch small kernels back to back."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _inc(x, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)

    x = torch.zeros(64, device="cuda" if torch.cuda.is_available() else "cpu")
    while not stop.is_set():
        _inc[(1,)](x, 64, BLOCK=64)


def proxy_cost(n_chunks: int, chunk: int, slots: int, qps: int, busy: bool) -> dict:
    """Rank 0 -> 1 over the null transport: the sender proxy's busy time per chunk and per WR."""
    wire = NullWire()
    ts = [NullTransport(r, 2, wire, num_qps_per_peer=qps, timeout_s=60.0) for r in range(2)]
    s = [Scheduler(t, slots=slots, slot_bytes=chunk) for t in ts]
    stop = threading.Event()
    loader = threading.Thread(target=busy_launcher, args=(stop,), daemon=True) if busy else None
    try:
        for x in s:
            x.start([y.remote_region() for y in s])
        if loader:
            loader.start()
            time.sleep(0.5)
        t0 = time.perf_counter()
        sent = 0
        head = 0
        deadline = time.monotonic() + 300
        while s[0].flags.get(1, 1) < n_chunks:            # RingFlags.SENT[1]
            while sent < n_chunks and s[0].slot_free(1, sent):
                s[0].publish(1, sent, chunk)                # host producer: nothing written, only published
                sent += 1
            tail = s[1].arrived(0)
            if tail > head:
                head = tail
                s[1].consume(0, head)
            s[0].check()
            s[1].check()
            if time.monotonic() > deadline:
                raise TimeoutError("proxy cost run did not finish")
            time.sleep(0)
        wall = time.perf_counter() - t0
        wrs = s[0].wrs_posted
        return {"chunks": n_chunks, "chunk_bytes": chunk, "wrs": wrs, "busy_launching": busy,
                "proxy_us_per_chunk": s[0].busy_s / n_chunks * 1e6, "proxy_us_per_wr": s[0].busy_s / wrs * 1e6,
                "wall_us_per_chunk": wall / n_chunks * 1e6, "wrs_per_s": wrs / s[0].busy_s}
    finally:
        stop.set()
        if loader:
            loader.join()
        for x in s:
            x.close()


def timeline(qps: int, chunk: int, slots: int, out: str) -> dict:
    """One 2-host all-to-all with tracing; writes the Chrome trace and the PNG; returns event counts."""
    import json
    fab = fabric(2, ring_bytes=4 << 20)
    data = [np.random.default_rng(r).integers(0, 256, 24 * chunk + 100, dtype=np.uint8) for r in range(2)]
    with Group(fab, 2, qps=qps, slots=slots, slot_bytes=chunk, trace=True) as g:
        in_threads(lambda r: host_alltoall(g.scheds[r], {1 - r: data[r]}, {1 - r: data[1 - r].size}), 2)
        t0 = min(x._t0 for x in g.scheds)
        evs = [(r, (e[0] + s._t0 - t0) / 1e3) + e[1:] for r, s in enumerate(g.scheds) for e in s.events]
    trace = []
    for r, t_us, kind, peer, ch, qp, seq, n in evs:
        lane = "producer" if kind == "produce" else f"{kind}s ch {ch} / QP {qp}"
        trace.append({"name": f"{kind} chunk {seq} -> {peer}" if kind != "arrive" else f"chunk {seq} from {peer}",
                      "ph": "X", "ts": t_us, "dur": 5, "pid": f"rank {r}", "tid": lane,
                      "args": {"peer": peer, "channel": ch, "qp": qp, "seq": seq, "bytes": n}})
    path = os.path.join(out, "scheduler_trace.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    say(f"wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        lanes = sorted({(e["pid"], e["tid"]) for e in trace})
        fig, ax = plt.subplots(figsize=(10, 0.3 * len(lanes) + 1.5))
        for i, lane in enumerate(lanes):
            xs = [e["ts"] / 1e3 for e in trace if (e["pid"], e["tid"]) == lane]
            ax.scatter(xs, [i] * len(xs), s=8, marker="|" if "producer" in lane[1] else "o")
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"{p}: {t}" for p, t in lanes], fontsize=7)
        ax.set_xlabel("ms (wall clock, emulated fabric on this CPU)")
        ax.set_title("one all-to-all, 2 hosts: producer chunks, posts per channel/QP, arrivals", fontsize=9)
        fig.tight_layout()
        png = os.path.join(out, "scheduler_trace.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        say(f"wrote {png}")
    except ImportError:
        say("matplotlib not installed: no timeline PNG")
    return {"events": len(trace)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per bandwidth scenario, MiB")
    ap.add_argument("--qps", type=int, default=8, help="QPs per peer of the full plan")
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=4000, help="chunks of the proxy-cost runs")
    add_out_arg(ap, "scheduler.json, scheduler_trace.json/.png")
    a = ap.parse_args(argv)
    chunk = a.chunk_kib << 10
    steps = progress(total=5, desc="bench_scheduler")
    one = model_bandwidth(1, a.mib, chunk, a.slots)
    steps.update()
    full = model_bandwidth(a.qps, a.mib, chunk, a.slots)
    steps.update()
    idle = proxy_cost(a.chunks, chunk, 2 * a.slots, a.qps, busy=False)
    steps.update()
    loaded = proxy_cost(a.chunks, chunk, 2 * a.slots, a.qps, busy=True)
    steps.update()
    tl = timeline(min(a.qps, 4), 64 << 10, 4, a.out)
    steps.update()
    steps.close()
    res = {"note": NOTE, "config": {k: v for k, v in vars(a).items() if k != "out"}, "cpus": os.cpu_count(),
           "model_bandwidth": {"one_channel_one_qp": one, "full_plan": full, "ratio": full["GBps"] / one["GBps"]},
           "proxy_cost": {"idle_main_thread": idle, "main_thread_launching": loaded}, "timeline": tl}
    write_json(os.path.join(a.out, "scheduler.json"), res)
    print(NOTE)
    print(f"model bandwidth (virtual time): 1 channel / 1 QP {one['GBps']:.1f} GB/s, full plan ({a.qps} QPs) "
          f"{full['GBps']:.1f} GB/s, ratio {res['model_bandwidth']['ratio']:.2f}x (target >= 1.9x)")
    print(f"bytes per port (full plan): {full['bytes_per_port']} (max {100 * full['port_max_dev_from_even']:.1f}% "
          f"from even; target <= 5%)")
    print(f"bytes per QP (full plan): {full['bytes_per_qp']}")
    for name, c in (("idle main thread", idle), ("main thread launching kernels", loaded)):
        print(f"proxy cost, {name}: {c['proxy_us_per_chunk']:.1f} us per {a.chunk_kib} KiB chunk (target <= 20), "
              f"{c['proxy_us_per_wr']:.1f} us per WR, {c['wrs_per_s']:.0f} WRs/s; wall {c['wall_us_per_chunk']:.1f} "
              f"us per chunk")


if __name__ == "__main__":
    main()
