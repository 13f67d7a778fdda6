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
   proxy threads in the benchmark's process, ``TRITON_EP_PROXY=thread``) and ``process`` (one proxy process
   holding both ranks' schedulers, ``TRITON_EP_PROXY=process``, the default on Linux). ``--busy``: ``none``; ``python``, a thread of the
   benchmark's process (the rank's) running exactly ``while not stop: x += 1`` at the default switch interval;
   ``launch``, a thread launching kernels (Triton-interpreted on CPU, compiled on GPU). Each busy load also
   runs as a control row with the loop in a process of its own (it shares the CPU, not the GIL). Figures:
   the helper's wall time per chunk (and its ratio to the idle row; target: ``python`` <= 1.5x), and the
   proxy's CPU time per chunk: every proxy thread, or every thread of the proxy process
   (``/proc/<pid>/task/<tid>/schedstat``), idle polling included, less the transport's own payload copies (none
   over the null transport).
3. A timeline of one all-to-all (2 hosts, full plan): Chrome-trace JSON (opens in Perfetto) and a PNG:
   producer chunks, posts per channel/QP, arrivals.
4. ``--parts proxy_cpu`` (not in the default parts): the proxy's own CPU over the emulated fabric, ranks as emulated
   hosts with one proxy thread each: per posted 1 MiB chunk of a normal-mode-like stream (chunks published one at a
   time, or a round of them with one store: ``normal-burst``) and per low-latency-like call and rank (WRITE_WITH_IMM
   signals, and arrival words), the proxy threads' CPU clock less what the emulated NIC
   counts as its own (its posts: doorbells since the NIC's progress thread copies the payloads; before, the payload
   copies and records as well); ``--before DIR`` also measures the triton_ep of another checkout
   (``git worktree add /tmp/before main``), alternately in worker processes, for a before / after in one run;
   ``--calls`` also counts the busy sweeps' Python calls per event (a figure the machine's load does not move).

    ./run.sh python benchmarks/bench_scheduler.py [--mib 64] [--qps 8] [--chunks 2000] [--busy none python launch]
        [--parts model cost timeline proxy_cpu] [--before DIR] [--calls] [--out DIR]

About 2 minutes on two CPU cores (Linux: it reads /proc).  Outputs: scheduler.json, scheduler_trace.json, scheduler_trace.png.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time

from _common import ROOT, add_out_arg, check_out, say, write_json

if os.environ.get(IMPL_ENV := "TRITON_EP_BENCH_IMPL"):
    # --parts proxy_cpu's workers: the triton_ep to measure (a checkout of another commit, for the "before")
    sys.path.insert(0, os.environ[IMPL_ENV])
import numpy as np  # noqa: E402

from tests.cases.sched_helpers import Group, fabric, in_threads  # noqa: E402
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
        from triton_ep.proxy_process import channel as pp
        self.pp = pp
        started = pp.start_proxy()
        self.proc, self.sock, self.bell = started.proc, started.sock, started.bell
        self._ask("bench_null_pair", list(paths), slots, chunk, qps)

    def _ask(self, *msg):
        self.pp.send_msg(self.sock, msg)
        got = self.pp.recv_msg(self.sock)
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
            os.close(self.bell)


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


#: the streams of ``--parts proxy_cpu``: normal mode's 1 MiB chunks, and low-latency calls (small chunks, 2 slots per
#: peer) with the chunk's signal a WRITE_WITH_IMM (the default) or an arrival word (``TRITON_EP_LL_ARRIVAL_WORDS``)
CPU_STREAMS = ("normal", "normal-burst", "ll", "ll-arrival")


def burst_alltoall(sched, sends, nbytes: int, timeout_s: float = 120.0) -> dict:
    """:func:`host_alltoall`'s exchange (``sends[p]``: ``nbytes`` uint8 bytes to each peer, as many from each), with
    the chunks of a round published together: every free send slot is filled, then one ``READY`` store publishes
    them (a normal-mode pack kernel's chunks land microseconds apart on a GPU, between two sweeps of the proxy), and
    what arrived is read out and consumed with one ``HEAD`` store. Returns peer -> received bytes. Raises the proxy's
    error, or ``TimeoutError`` after ``timeout_s`` without progress."""
    C, peers = sched.slot_bytes, list(sends)
    n = -(-nbytes // C)
    tx0, rx0 = sched.reserve({p: n for p in peers}, {p: n for p in peers})
    done_tx, done_rx = dict.fromkeys(peers, 0), dict.fromkeys(peers, 0)
    out = {p: np.empty(nbytes, np.uint8) for p in peers}
    flags, READY, SENT = sched.flags, type(sched.flags).READY, type(sched.flags).SENT
    last, idle = time.monotonic(), 0
    while any(done_tx[p] < n or done_rx[p] < n or flags.get(SENT, p) < tx0[p] + n for p in peers):
        sched.check()
        moved = False
        for p in peers:
            k0 = done_tx[p]
            while done_tx[p] < n and sched.slot_free(p, tx0[p] + done_tx[p]):
                k = done_tx[p]
                piece = sends[p][k * C:(k + 1) * C]
                sched.send_view(p, tx0[p] + k)[:len(piece)] = piece
                flags.set_len(p, tx0[p] + k, len(piece))
                done_tx[p] += 1
            if done_tx[p] > k0:
                flags.put(READY, p, tx0[p] + done_tx[p])
                moved = True
            k0, tail = done_rx[p], min(n, sched.arrived(p) - rx0[p])
            while done_rx[p] < tail:
                k = done_rx[p]
                m = min(C, nbytes - k * C)
                out[p][k * C:k * C + m] = sched.recv_view(p, rx0[p] + k)[:m]
                done_rx[p] += 1
            if done_rx[p] > k0:
                sched.consume(p, rx0[p] + done_rx[p])
                moved = True
        if moved:
            last, idle = time.monotonic(), 0
            continue
        if time.monotonic() - last > timeout_s:
            raise TimeoutError(f"rank {sched.rank}: burst exchange made no progress for {timeout_s:g} s")
        idle += 1
        time.sleep(0 if idle < 50 else 0.0002)
    return out


def _proxy_cpu_profiled(prof_out: list):
    """Replace ``Scheduler._run`` so each proxy thread runs under ``cProfile`` with the thread's CPU clock as its
    timer (``time.thread_time``: what the thread ran, not what it waited); the profiles go into ``prof_out``."""
    import cProfile
    run = Scheduler._run

    def _run(self, own):
        prof = cProfile.Profile(time.thread_time)
        prof_out.append(prof)
        prof.runcall(run, self, own)
    Scheduler._run = _run


def _proxy_calls_counted() -> None:
    """Replace ``Scheduler._sweep`` so each sweep counts the Python calls it makes (``sys.setprofile`` in the proxy
    thread: function calls and builtin calls, whatever the load), leaving out everything under the emulated NIC's
    ``post_send`` / ``post_recv`` (its doorbell); a busy sweep adds its count to the scheduler's ``_bench_calls``
    (the proxy thread holds the scheduler's lock around a sweep). It slows the sweeps: with it, the CPU figures are
    not the proxy's cost."""
    run = Scheduler._sweep

    def _sweep(self, own):
        n = [0, 0]          # calls, depth inside the NIC's post

        def count(frame, event, arg):
            if event == "call":
                if n[1]:
                    n[1] += 1
                elif frame.f_code.co_name in ("post_send", "post_recv") and "emulated" in frame.f_code.co_filename:
                    n[1] = 1
                else:
                    n[0] += 1
            elif event == "return":
                if n[1]:
                    n[1] -= 1
            elif event == "c_call" and not n[1]:
                n[0] += 1
        sys.setprofile(count)
        try:
            did = run(self, own)
        finally:
            sys.setprofile(None)
        if did:
            self._bench_calls = getattr(self, "_bench_calls", 0) + n[0] - 1     # (less the setprofile call)
        return did
    Scheduler._sweep = _sweep


def proxy_cpu_stream(stream: str, cfg: dict) -> list:
    """One ``--parts proxy_cpu`` stream (in a worker process: ``TRITON_EP_BENCH_IMPL`` picks the triton_ep measured):
    ranks as emulated hosts in this process (:class:`~tests.cases.sched_helpers.Group`, one proxy thread each),
    host producers and consumers (:func:`host_alltoall`, in threads of their own). ``normal``: 2 ranks, each sends
    the other ``cpu_mib`` MiB in ``chunk_kib`` chunks over ``qps`` QPs and ``slots`` slots; ``ll`` / ``ll-arrival``:
    ``ll_ranks`` ranks, ``ll_calls`` calls, a call = a dispatch and a combine, each one chunk of ``ll_kib`` KiB to
    every peer (2 slots, ``ll_qps`` QPs). Returns per repetition (after a warm-up round) the proxy threads' CPU in
    the sweeps that moved something (``stats()["proxy_cpu_s"]``: the thread's own CPU clock) and in all
    (``/proc/.../schedstat``: idle polling included), each less what the emulated NIC counts as its own
    (:func:`~triton_ep.transport.emulated.nic_cpu_s`: the CPU inside its ``post_send`` / ``post_recv``), per posted chunk (normal) or per call and rank (low latency)."""
    from triton_ep.transport import emulated as em
    normal, burst = stream.startswith("normal"), stream == "normal-burst"
    world = 2 if normal else cfg["ll_ranks"]
    chunk = cfg["chunk_kib"] << 10 if normal else 2 * cfg["ll_kib"] << 10
    qps = (cfg["burst_qps"] if burst else cfg["qps"]) if normal else cfg["ll_qps"]
    kw = dict(qps=qps, slots=cfg["slots"] if normal else 2, slot_bytes=chunk, timeout_s=120.0)
    if stream == "ll-arrival":
        kw["arrival_words"] = True
    nbytes = cfg["cpu_mib"] << 20 if normal else cfg["ll_kib"] << 10
    rounds = 1 if normal else cfg["ll_calls"]
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    out = []
    with Group(fabric(world, ring_bytes=4 << 20), world, **kw) as g:
        def rank(r, n):
            peers = [p for p in range(world) if p != r]
            for _ in range(n):
                for _half in range(1 if normal else 2):       # (low latency: dispatch, then combine)
                    if burst:
                        got = burst_alltoall(g.scheds[r], {p: data for p in peers}, data.size)
                    else:
                        got = host_alltoall(g.scheds[r], {p: data for p in peers}, {p: data.size for p in peers})
            assert all(np.array_equal(v, data) for v in got.values())

        def go(n):
            for x in in_threads(lambda r: rank(r, n), world, timeout_s=600):
                if isinstance(x, BaseException):
                    raise x

        def snap():
            st = [s.stats() for s in g.scheds]
            return (sum(x["proxy_cpu_s"] for x in st), task_cpu_ns(tasks) / 1e9, em.nic_cpu_s(),
                    sum(q["chunks"] for x in st for q in x["qps"].values()), sum(x["proxy_busy_sweeps"] for x in st),
                    sum(getattr(s, "_bench_calls", 0) for s in g.scheds))

        tasks = [(os.getpid(), th.native_id) for s in g.scheds for th in s._threads]
        go(1 if normal else 4)      # warm-up
        for _ in range(cfg["cpu_reps"]):
            b0, t0, n0, c0, w0, k0 = snap()
            go(rounds)
            b1, t1, n1, c1, w1, k1 = snap()
            per = (c1 - c0) if normal else rounds * world
            out.append({"busy_us": (b1 - b0 - (n1 - n0)) / per * 1e6, "all_us": (t1 - t0 - (n1 - n0)) / per * 1e6,
                        "nic_us": (n1 - n0) / per * 1e6, "chunks": c1 - c0, "per": "chunk" if normal else "call, rank",
                        "busy_sweeps": (w1 - w0) / per, "calls": (k1 - k0) / per if cfg.get("calls") else None})
    return out


def proxy_cpu_worker(cfg: dict) -> None:
    """A worker of ``--parts proxy_cpu``: every stream of ``cfg["streams"]``; prints one JSON line (stream ->
    repetitions), with ``cfg["profile"]`` the proxy threads' top functions by CPU time on stderr."""
    import json
    profs: list = []
    if cfg.get("profile"):
        _proxy_cpu_profiled(profs)
    if cfg.get("calls"):
        _proxy_calls_counted()
    res = {st: proxy_cpu_stream(st, cfg) for st in cfg["streams"]}
    if profs:
        import pstats
        ps = pstats.Stats(profs[0], stream=sys.stderr)
        for x in profs[1:]:
            ps.add(x)
        ps.sort_stats("tottime").print_stats(35)
    print(json.dumps(res))


def proxy_cpu_rows(a) -> dict:
    """``--parts proxy_cpu``: the proxy's CPU per event (:func:`proxy_cpu_stream`) of this checkout ("after") and,
    with ``--before DIR`` (a checkout of another commit, e.g. ``git worktree add /tmp/before main``), of that one
    ("before"), in worker processes run alternately ``--cpu-rounds`` times; medians over every repetition."""
    import json
    import statistics
    import subprocess
    cfg = dict(streams=a.cpu_streams, cpu_mib=a.cpu_mib, chunk_kib=a.chunk_kib, qps=a.qps, slots=a.slots,
               burst_qps=a.burst_qps,
               ll_ranks=a.ll_ranks, ll_kib=a.ll_kib, ll_qps=a.ll_qps, ll_calls=a.ll_calls, cpu_reps=a.cpu_reps,
               profile=a.profile, calls=a.calls)
    impls = ([("before", os.path.abspath(a.before))] if a.before else []) + [("after", ROOT)]
    got = {name: {st: [] for st in a.cpu_streams} for name, _ in impls}
    for rnd in range(a.cpu_rounds):
        for name, path in impls:
            env = dict(os.environ, TRITON_EP_BENCH_IMPL=path)
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--proxy-cpu-worker", json.dumps(cfg)],
                               env=env, stdout=subprocess.PIPE, stderr=None if a.profile else subprocess.PIPE,
                               text=True, timeout=1800)
            if r.returncode:
                raise RuntimeError(f"proxy_cpu worker ({name}, {path}) failed:\n{r.stderr}")
            for st, reps in json.loads(r.stdout.strip().splitlines()[-1]).items():
                got[name][st] += reps
                busy, every = (" / ".join(f"{x[k]:.1f}" for x in reps) for k in ("busy_us", "all_us"))
                calls = f", {reps[0]['calls']:.0f} Python calls" if a.calls else ""
                say(f"round {rnd + 1} {name:6s} {st:10s}: proxy CPU less NIC, busy sweeps {busy} us, all {every} us "
                    f"per {reps[0]['per']} ({reps[0]['busy_sweeps']:.2f} busy sweeps{calls})")
    rows = {}
    for name, _ in impls:
        for st, reps in got[name].items():
            rows[f"{name}/{st}"] = {"impl": name, "stream": st, "per": reps[0]["per"], "runs": len(reps),
                                    **{f"{k}_median": statistics.median(x[k] for x in reps)
                                       for k in ("busy_us", "all_us", "nic_us", "busy_sweeps")
                                       + (("calls",) if a.calls else ())},
                                    "busy_us": [x["busy_us"] for x in reps], "all_us": [x["all_us"] for x in reps]}
    return {"config": cfg, "before": a.before and os.path.abspath(a.before), "load_avg": os.getloadavg(),
            "rows": rows}


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
    ap.add_argument("--parts", nargs="+", choices=("model", "cost", "timeline", "proxy_cpu"),
                    default=["model", "cost", "timeline"],
                    help="what to run (default: model cost timeline; proxy_cpu: the proxy's own CPU per chunk and per "
                         "low-latency call over the emulated fabric, see --before)")
    ap.add_argument("--before", metavar="DIR",
                    help="proxy_cpu: also measure the triton_ep of this checkout (e.g. 'git worktree add /tmp/before "
                         "main'), alternately with this one")
    ap.add_argument("--cpu-streams", nargs="+", choices=CPU_STREAMS, default=list(CPU_STREAMS),
                    help="proxy_cpu: normal (1 MiB chunks, 2 hosts), normal-burst (the same, a round of chunks "
                         "published with one store, as a kernel's land between two sweeps, over --burst-qps QPs), "
                         "ll (low-latency calls, WRITE_WITH_IMM signals), "
                         "ll-arrival (arrival words)")
    ap.add_argument("--cpu-mib", type=int, default=32, help="proxy_cpu normal: MiB each way per repetition")
    ap.add_argument("--burst-qps", type=int, default=4,
                    help="proxy_cpu normal-burst: QPs per peer (default 4, a normal-mode Buffer's "
                         "TRITON_EP_RDMA_QPS_PER_PEER default)")
    ap.add_argument("--ll-ranks", type=int, default=2, help="proxy_cpu ll: ranks (each an emulated host)")
    ap.add_argument("--ll-kib", type=int, default=16, help="proxy_cpu ll: KiB to each peer per dispatch / combine")
    ap.add_argument("--ll-qps", type=int, default=4, help="proxy_cpu ll: QPs per peer")
    ap.add_argument("--ll-calls", type=int, default=50, help="proxy_cpu ll: calls per repetition")
    ap.add_argument("--cpu-reps", type=int, default=3, help="proxy_cpu: repetitions per worker process")
    ap.add_argument("--cpu-rounds", type=int, default=2, help="proxy_cpu: worker processes per checkout, alternating")
    ap.add_argument("--profile", action="store_true",
                    help="proxy_cpu: print the proxy threads' top functions by CPU time (cProfile, thread CPU clock; "
                         "it slows them: the figures then are not the proxy's cost)")
    ap.add_argument("--calls", action="store_true",
                    help="proxy_cpu: also count the Python calls of the busy sweeps per chunk / call and rank "
                         "(sys.setprofile, outside the emulated NIC's posts: a figure the machine's load does not move; "
                         "it slows the sweeps: the CPU figures then are not the proxy's cost)")
    ap.add_argument("--proxy-cpu-worker", metavar="JSON", help=argparse.SUPPRESS)
    add_out_arg(ap, "scheduler.json, scheduler_trace.json/.png")
    a = ap.parse_args(argv)
    if a.proxy_cpu_worker:
        import json
        return proxy_cpu_worker(json.loads(a.proxy_cpu_worker))
    for k in ("chunks", "busy_chunks", "slots", "qps", "burst_qps", "chunk_kib", "mib", "cpu_mib", "ll_ranks", "ll_kib",
              "ll_qps", "ll_calls", "cpu_reps", "cpu_rounds"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    check_out(ap, a.out)
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
    if "proxy_cpu" in a.parts:
        res["proxy_cpu"] = proxy_cpu_rows(a)
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
    if "proxy_cpu" in a.parts:
        pc = res["proxy_cpu"]
        print(f"proxy CPU less the emulated NIC's own (thread CPU clock; medians of {a.cpu_rounds} x {a.cpu_reps} runs; "
              f"load average {pc['load_avg'][0]:.1f}; targets: 10 us a 1 MiB chunk, 25 us a low-latency call and rank):")
        print(f"{'impl':7s} {'stream':12s} {'per':11s} {'busy sweeps us':>15s} {'all sweeps us':>14s} {'NIC us':>8s} "
              f"{'busy sweeps':>12s}" + (f" {'Python calls':>13s}" if a.calls else ""))
        for r in pc["rows"].values():
            print(f"{r['impl']:7s} {r['stream']:12s} {r['per']:11s} {r['busy_us_median']:15.1f} "
                  f"{r['all_us_median']:14.1f} {r['nic_us_median']:8.1f} {r['busy_sweeps_median']:12.2f}"
                  + (f" {r['calls_median']:13.0f}" if a.calls else ""))


if __name__ == "__main__":
    main()
