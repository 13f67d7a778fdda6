"""Benchmark of the RDMA scheduler (triton_ep/scheduler.py).

1. Model bandwidth (the emulated fabric's virtual time, a model result: it shows the scheduler's channel
   choice, not hardware): rank 0 sends ``--mib`` MiB to rank 1 through the scheduler, each host one
   dual-port NIC model (400 Gb/s ports) over 4 ECMP paths of 200 Gb/s; 1 channel on 1 QP against the full
   plan (``--qps`` QPs per peer over both ports, source ports spread by the QP plan).  Ratio target >= 1.9x.
   Bytes per port and per QP of the full plan (each port within 5% of even).
2. Proxy cost, over a null Transport (completions at once, no payload moved: the emulator copies payloads in the
   posting thread, so it would time itself): rank 0 sends ``--chunks`` chunks of ``--chunk-kib`` to rank 1.
   The producer and consumer stand in for kernels, so they run in a helper process (in the benchmark's main
   thread a busy thread would starve them in any design of the proxy). ``--proxy``: ``thread`` (both ranks'
   proxy threads in the benchmark's process, today's default) and ``process`` (one proxy process holding both
   ranks' schedulers, ``TRITON_EP_PROXY=process``). ``--busy``: ``none``; ``python``, a thread of the
   benchmark's process (the rank's) running exactly ``while not stop: x += 1`` at the default switch interval;
   ``launch``, a thread launching kernels (Triton-interpreted on CPU, compiled on GPU). Each busy load also
   runs as a control row with the loop in a process of its own (it shares the CPU, not the GIL). Figures:
   the helper's wall time per chunk (and its ratio to the idle row; target: ``python`` <= 1.5x), and the
   proxy's CPU time per chunk: every proxy thread, or every thread of the proxy process
   (``/proc/<pid>/task/<tid>/schedstat``), idle polling included, less the transport's own payload copies (none
   over the null transport).
3. A timeline of one all-to-all (2 hosts, full plan): Chrome-trace JSON (opens in Perfetto) and a PNG:
   producer chunks, posts per channel/QP, arrivals.

    ./run.sh python benchmarks/bench_scheduler.py [--mib 64] [--qps 8] [--chunks 2000] [--busy none python launch]
        [--parts model cost timeline] [--out DIR]

About 2 minutes on two CPU cores (Linux: it reads /proc).  Outputs: scheduler.json, scheduler_trace.json, scheduler_trace.png.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time

from _common import ROOT, add_out_arg, say, write_json

sys.path.insert(0, os.path.join(ROOT, "tests"))
import numpy as np  # noqa: E402

from sched_helpers import Group, fabric, in_threads  # noqa: E402
from triton_ep.scheduler import RingLayout, Scheduler, host_alltoall  # noqa: E402
from triton_ep.transport.null import NullTransport, NullWire  # noqa: E402

NOTE = ("measured on this machine's CPU: bandwidths are the emulator's virtual time (a model of the NICs and "
        "fabric, not hardware); proxy costs are over a null transport (no verbs calls), so on real NICs add "
        "the cost of the verbs calls themselves; on 2 shared cores the busy rows vary from run to run")


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


def busy_launcher(stop) -> None:
    """``--busy launch``: hold the GIL as a training loop's main thread does, launching small kernels back to back
    (Triton-interpreted launches on CPU, compiled ones on GPU, whose launcher lets the GIL go). ``stop[0]`` ends
    it."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _inc(x, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)

    x = torch.zeros(64, device="cuda" if torch.cuda.is_available() else "cpu")
    while not stop[0]:
        _inc[(1,)](x, 64, BLOCK=64)


def busy_python(stop) -> None:
    """``--busy python``: plain Python at the default switch interval, what a serving engine's scheduler runs
    while the GPU works; exactly ``while not stop: x += 1`` (``stop[0]`` ends it)."""
    x = 0
    while not stop[0]:
        x += 1


def _busy_process(kind: str, conn) -> None:
    """The control row's busy loop, in a process of its own (it shares the CPU with the proxy, not the GIL):
    runs until the benchmark sends anything on ``conn``."""
    stop = [False]
    th = threading.Thread(target=lambda: (conn.recv(), stop.__setitem__(0, True)), daemon=True)
    th.start()
    (busy_launcher if kind == "launch" else busy_python)(stop)


def task_cpu_ns(tids) -> int:
    """CPU nanoseconds the Linux tasks ``tids`` (``(pid, native thread id)`` pairs) ran so far
    (``/proc/<pid>/task/<tid>/schedstat``'s first field, nanoseconds, user and system; a task that ended: 0)."""
    total = 0
    for pid, tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def process_tasks(pid: int) -> list:
    """Every task (thread) of process ``pid`` now, as ``(pid, tid)`` pairs."""
    try:
        return [(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _producer_consumer(paths, world: int, slots: int, chunk: int, n_chunks: int, conn) -> None:
    """The helper process standing in for the kernels: maps both ranks' ring regions (``paths``), produces
    ``n_chunks`` chunks 0 -> 1 (nothing written, only published) and consumes them at rank 1, once the benchmark
    says go; sends back its wall seconds from the first publish to the last chunk placed."""
    import mmap

    from triton_ep.transport.signals import RingFlags

    lay = RingLayout(world, slots, chunk)
    maps, flags = [], []
    for r, path in enumerate(paths):
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), lay.nbytes)
        maps.append(m)
        flags.append(RingFlags(np.frombuffer(m, np.int64, lay.ctrl_bytes // 8), r, world, slots))
    tx, rx = flags
    conn.send("ready")
    conn.recv()
    t0 = time.perf_counter()
    sent = head = 0
    deadline = time.monotonic() + 600
    err = None
    while tx.get(RingFlags.SENT, 1) < n_chunks:
        while sent < n_chunks and tx.get(RingFlags.SENT, 1) > sent - slots:
            tx.set_len(1, sent, chunk)
            tx.put(RingFlags.READY, 1, sent + 1)
            sent += 1
        tail = rx.get(RingFlags.TAIL, 0)
        if tail > head:
            head = tail
            rx.put(RingFlags.HEAD, 0, head)
        if tx.aborted or rx.aborted or time.monotonic() > deadline:
            err = f"the proxy-cost run stopped at chunk {tx.get(RingFlags.SENT, 1)} of {n_chunks} (abort words " \
                  f"{tx.aborted}, {rx.aborted})"
            break
        time.sleep(0)
    wall = time.perf_counter() - t0
    del tx, rx, flags
    conn.send((wall, err))


class _ThreadProxies:
    """Today's proxy: the two ranks' schedulers over one null wire, their proxy threads in this process."""

    def __init__(self, mems, chunk: int, slots: int, qps: int) -> None:
        wire = NullWire()
        ts = [NullTransport(r, 2, wire, num_qps_per_peer=qps, timeout_s=60.0) for r in range(2)]
        self.s = [Scheduler(t, slots=slots, slot_bytes=chunk, memory=m) for t, m in zip(ts, mems)]
        for x in self.s:
            x.start([y.remote_region() for y in self.s])

    def tasks(self) -> list:
        """The proxy threads as ``(pid, tid)`` pairs."""
        return [(os.getpid(), th.native_id) for x in self.s for th in x._threads]

    def copy_s(self) -> float:
        """Seconds the transport spent copying payloads (the null transport copies none)."""
        return 0.0

    def check(self) -> None:
        for x in self.s:
            x.check()

    def close(self) -> None:
        for x in self.s:
            x.close()


class _ProcessProxies:
    """The proxy as a process of its own (``TRITON_EP_PROXY=process``): one proxy process holding both ranks'
    schedulers over one null wire (as the thread row holds both in this process), on the same rings."""

    def __init__(self, paths, chunk: int, slots: int, qps: int) -> None:
        from triton_ep import proxy_process as pp
        self.pp = pp
        self.proc, self.sock = pp.start_proxy()
        self._ask("bench_null_pair", list(paths), slots, chunk, qps)

    def _ask(self, *msg):
        self.pp._send(self.sock, msg)
        got = self.pp._recv(self.sock)
        if got is None:
            raise RuntimeError("the proxy process ended")
        if got[0] in ("error", "err"):      # (the proxy's failure, or the command's)
            raise self.pp.unpack_error(got[1])
        return got[1]

    def tasks(self) -> list:
        """Every thread of the proxy process."""
        return process_tasks(self.proc.pid)

    def copy_s(self) -> float:
        return 0.0

    def check(self) -> None:
        self._ask("stats")

    def close(self) -> None:
        try:
            self._ask("close")
        finally:
            self.proc.wait(30)
            self.sock.close()


def proxy_cost(n_chunks: int, chunk: int, slots: int, qps: int, busy: str, proxy: str = "thread") -> dict:
    """Rank 0 -> 1 over the null transport, the producer and consumer in a helper process, ``busy``: ``"none"``,
    ``"python"`` / ``"launch"`` (a busy thread in this process, the proxy's when it is a thread), or
    ``"python-process"`` / ``"launch-process"`` (the control rows: the busy loop in a process of its own).
    Returns the helper's wall time per chunk and the proxy's CPU time per chunk (every proxy thread, or the whole
    proxy process; less the transport's payload copies: none over the null transport)."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    lay = RingLayout(2, slots, chunk)
    paths, maps = [], []
    for r in range(2):
        fd, path = tempfile.mkstemp(prefix=f"triton_ep.bench_sched.{os.getpid()}.r{r}.", dir="/dev/shm")
        try:
            os.posix_fallocate(fd, 0, lay.nbytes)
            maps.append(mmap.mmap(fd, lay.nbytes))
        finally:
            os.close(fd)
        paths.append(path)
    stop = [False]
    loader = ctl = helper = prox = None
    mine, theirs = ctx.Pipe()
    try:
        if proxy == "thread":
            prox = _ThreadProxies([np.frombuffer(m, np.uint8) for m in maps], chunk, slots, qps)
        else:
            prox = _ProcessProxies(paths, chunk, slots, qps)
        helper = ctx.Process(target=_producer_consumer, args=(paths, 2, slots, chunk, n_chunks, theirs), daemon=True)
        helper.start()
        if mine.poll(120):
            mine.recv()
        else:
            raise TimeoutError("the producer/consumer process did not start within 120 s")
        if busy in ("python", "launch"):
            loader = threading.Thread(target=busy_python if busy == "python" else busy_launcher, args=(stop,),
                                      daemon=True)
            loader.start()
        elif busy.endswith("-process"):
            ctl, ctl_child = ctx.Pipe()
            bp = ctx.Process(target=_busy_process, args=(busy.split("-")[0], ctl_child), daemon=True)
            bp.start()
            ctl = (ctl, bp)
        time.sleep(0.5)
        tasks = prox.tasks()
        cpu0, copy0 = task_cpu_ns(tasks), prox.copy_s()
        mine.send("go")
        if not mine.poll(900):
            raise TimeoutError("the proxy-cost run did not finish within 900 s")
        wall, err = mine.recv()
        cpu = (task_cpu_ns(tasks) - cpu0) / 1e9 - (prox.copy_s() - copy0)
        prox.check()
        if err:
            raise RuntimeError(err)
        return {"proxy": proxy, "busy": busy, "chunks": n_chunks, "chunk_bytes": chunk,
                "wall_us_per_chunk": wall / n_chunks * 1e6, "proxy_cpu_us_per_chunk": cpu / n_chunks * 1e6}
    finally:
        stop[0] = True
        if loader:
            loader.join()
        if ctl:
            ctl[0].send("stop")
            ctl[1].join(30)
        if helper is not None:
            helper.join(30)
            if helper.is_alive():
                helper.kill()
                helper.join()
        if prox is not None:
            prox.close()
        for path in paths:
            os.unlink(path)
        del prox
        for m in maps:
            try:
                m.close()
            except BufferError:     # a view still held: the mapping goes with it
                pass


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


BUSY = ("none", "python", "launch")


def cost_rows(a, chunk: int) -> dict:
    """The proxy-cost table: per proxy kind and busy load, the wall and CPU figures, and the ratios to the same
    proxy's idle row (``--busy`` loads; the control rows put the same busy loop in a process of its own)."""
    rows = {}
    for proxy in a.proxy:
        base = None
        for busy in ["none"] + [b for b in a.busy if b != "none"] + [f"{b}-process" for b in a.busy if b != "none"]:
            n = a.chunks if busy == "none" else a.busy_chunks
            r = proxy_cost(n, chunk, 2 * a.slots, a.qps, busy, proxy)
            base = base or r
            r["wall_x_idle"] = r["wall_us_per_chunk"] / base["wall_us_per_chunk"]
            rows[f"{proxy}/{busy}"] = r
            say(f"proxy {proxy:7s} busy {busy:15s}: wall {r['wall_us_per_chunk']:9.1f} us/chunk "
                f"({r['wall_x_idle']:6.1f}x idle), proxy CPU {r['proxy_cpu_us_per_chunk']:7.1f} us/chunk")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per bandwidth scenario, MiB")
    ap.add_argument("--qps", type=int, default=8, help="QPs per peer of the full plan")
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2000, help="chunks of the idle proxy-cost runs")
    ap.add_argument("--busy-chunks", type=int, default=200,
                    help="chunks of the proxy-cost runs under a busy load (a thread proxy waits up to the 5 ms "
                         "switch interval per sweep there)")
    ap.add_argument("--busy", nargs="+", choices=BUSY, default=list(BUSY),
                    help="loads of the proxy-cost runs: none, python (a thread running exactly 'while not stop: "
                         "x += 1'), launch (a thread launching kernels); each non-idle load also runs as a "
                         "control row with the loop in a process of its own (default: all)")
    ap.add_argument("--proxy", nargs="+", choices=("thread", "process"), default=["thread", "process"],
                    help="proxy kinds to measure (thread: the proxy threads in the benchmark's process, which "
                         "also runs the busy thread; process: a proxy process of its own, TRITON_EP_PROXY=process)")
    ap.add_argument("--parts", nargs="+", choices=("model", "cost", "timeline"), default=["model", "cost", "timeline"],
                    help="what to run (default: all)")
    add_out_arg(ap, "scheduler.json, scheduler_trace.json/.png")
    a = ap.parse_args(argv)
    for k in ("chunks", "busy_chunks", "slots", "qps", "chunk_kib", "mib"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    chunk = a.chunk_kib << 10
    res = {"note": NOTE, "config": {k: v for k, v in vars(a).items() if k != "out"}, "cpus": os.cpu_count()}
    if "model" in a.parts:
        one = model_bandwidth(1, a.mib, chunk, a.slots)
        full = model_bandwidth(a.qps, a.mib, chunk, a.slots)
        res["model_bandwidth"] = {"one_channel_one_qp": one, "full_plan": full, "ratio": full["GBps"] / one["GBps"]}
    if "cost" in a.parts:
        res["proxy_cost"] = cost_rows(a, chunk)
    if "timeline" in a.parts:
        res["timeline"] = timeline(min(a.qps, 4), 64 << 10, 4, a.out)
    write_json(os.path.join(a.out, "scheduler.json"), res)
    print(NOTE)
    if "model" in a.parts:
        one, full = res["model_bandwidth"]["one_channel_one_qp"], res["model_bandwidth"]["full_plan"]
        print(f"model bandwidth (virtual time): 1 channel / 1 QP {one['GBps']:.1f} GB/s, full plan ({a.qps} QPs) "
              f"{full['GBps']:.1f} GB/s, ratio {res['model_bandwidth']['ratio']:.2f}x (target >= 1.9x)")
        print(f"bytes per port (full plan): {full['bytes_per_port']} (max {100 * full['port_max_dev_from_even']:.1f}% "
              f"from even; target <= 5%)")
        print(f"bytes per QP (full plan): {full['bytes_per_qp']}")
    if "cost" in a.parts:
        print(f"proxy cost per {a.chunk_kib} KiB chunk (null transport; wall: the producer/consumer process's, "
              f"CPU: the proxy's own, every thread of it; target: busy python <= 1.5x idle):")
        print(f"{'proxy':8s} {'busy':16s} {'wall us':>10s} {'x idle':>8s} {'proxy CPU us':>13s}")
        for r in res["proxy_cost"].values():
            print(f"{r['proxy']:8s} {r['busy']:16s} {r['wall_us_per_chunk']:10.1f} {r['wall_x_idle']:8.2f} "
                  f"{r['proxy_cpu_us_per_chunk']:13.1f}")


if __name__ == "__main__":
    main()
