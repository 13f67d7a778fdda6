"""The proxy process's side: :func:`serve`, its loop over the command channel, the state it serves (the mapped
rings, the transport, the scheduler) and :class:`ProxySweeps`, the scheduler with an idle back-off. Imported in the
proxy process, which has neither torch nor Triton (:mod:`triton_ep.proxy_main`)."""
from __future__ import annotations

import mmap
import os
import select
import socket
import sys
import time
from typing import Any, Dict, Optional

import numpy as np

from triton_ep.errors import EPTimeoutError
from triton_ep.scheduler import RingLayout, Scheduler
from triton_ep.transport.parent import PARENT_GONE_STATUS, PARENT_POLL_S, ParentWatch

from .channel import pack_error, recv_msg, send_msg, unpack_error

#: the proxy process's idle back-off (:class:`ProxySweeps`): sweeps that moved nothing followed by a yield only,
#: then the first nap (seconds), doubling up to the last
IDLE_SPINS, IDLE_FIRST_S, IDLE_MAX_S = 20, 25e-6, 200e-6
#: after this many idle sweeps in a row (about 50 ms at the naps above) the naps are :data:`IDLE_DEEP_S` long, until
#: a sweep moves something or the rank rings the doorbell
IDLE_DEEP_AFTER, IDLE_DEEP_S = 200, 2e-3


class ProxySweeps(Scheduler):
    """The proxy process's :class:`~triton_ep.scheduler.Scheduler`: the same sweeps, with an idle back-off and a
    doorbell. A proxy thread naps 50 µs between idle sweeps and, while the rank's Python runs, waits for the GIL
    besides; a proxy process has a core to itself, so at a fixed short nap every idle proxy would poll for good
    (four ranks with four such proxies on 2 cores made a 9 s test take 89 s). Here, after :data:`IDLE_SPINS` idle
    sweeps with only a yield between them, the nap starts at :data:`IDLE_FIRST_S` and doubles up to
    :data:`IDLE_MAX_S`; after :data:`IDLE_DEEP_AFTER` idle sweeps (about 50 ms) it is :data:`IDLE_DEEP_S`. A sweep
    that moves something starts over, and so does the doorbell (``bell``, an eventfd the rank's process writes at
    each call's host check and each host-published chunk: :meth:`ProcessScheduler.ring
    <triton_ep.proxy_process.ProcessScheduler.ring>`), which also ends a nap at once. A chunk that a kernel
    publishes into an idle proxy waits at most about one nap (plus the kernel's timer slack, some 50 µs) before
    its post: 200 µs within 50 ms of the last thing that moved or of the call's start, 2 ms after that (a CUDA
    graph replayed after a pause of more than 50 ms, whose launch the library does not see).

    Args:
        bell: the doorbell's descriptor (an eventfd), or ``None`` (naps end on their time only).
        *args, **kwargs: those of :class:`~triton_ep.scheduler.Scheduler`.
    """

    def __init__(self, *args, bell: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bell = bell

    def _idle_wait(self, idle: int) -> bool:
        if idle < IDLE_SPINS:
            time.sleep(0)
            return False
        nap = IDLE_DEEP_S if idle > IDLE_DEEP_AFTER else min(IDLE_MAX_S, IDLE_FIRST_S * (1 << min(idle - IDLE_SPINS, 16)))
        if self.bell is None:
            time.sleep(nap)
            return False
        if not select.select([self.bell], [], [], nap)[0]:
            return False
        try:
            os.eventfd_read(self.bell)      # (another sweep thread may have read it first)
        except BlockingIOError:
            pass
        return True


class _Served:
    """The proxy process's state: the mapped rings, the transport, the scheduler."""

    def __init__(self, bell: Optional[int] = None) -> None:
        self.bell = bell
        self.mem = self.transport = self.sched = self.fabric = None
        self.reported = False

    def handle(self, msg: tuple):
        """Run one command; returns ``(reply, done)``."""
        cmd, args = msg[0], msg[1:]
        try:
            val = getattr(self, f"cmd_{cmd}")(*args)
        except BaseException as ex:   # noqa: BLE001  (it goes back to the rank)
            return ("err", pack_error(ex)), False
        return ("ok", val), cmd == "close"

    def cmd_setup(self, cfg: dict):
        from triton_ep.transport import factory
        n = cfg["nbytes"]
        with open(cfg["path"], "r+b") as f:
            self._map = mmap.mmap(f.fileno(), n)
        self.mem = np.frombuffer(self._map, np.uint8)
        self.fabric = cfg["transport_kw"].get("fabric")
        self.transport = factory.open_transport(cfg["backend"], cfg["rank"], cfg["world"], **cfg["transport_kw"])
        self.sched_kw = cfg["sched_kw"]
        return {p: self.transport.local_info(p) for p in self.transport.peer_ranks()}

    def cmd_connect(self, remote: Dict[int, Any]):
        for p, info in remote.items():
            self.transport.connect(p, info)
        self.sched = ProxySweeps(self.transport, memory=self.mem, bell=self.bell, **self.sched_kw)
        return self.sched.remote_region()

    def cmd_start(self, remotes):
        self.sched.start(remotes)
        if self.fabric is not None:     # every peer has mapped this process's fabric rings
            self.fabric.unlink_rings()

    def cmd_wait_quiet(self, peer: int, stage: str):
        self.sched.wait_quiet(peer, stage)

    def cmd_rebase(self, peer: int, tx: int, rx: int):
        self.sched.rebase(peer, tx, rx)

    def cmd_fail(self, packed: tuple):
        if self.sched is not None:
            self.reported = True        # (the rank has it)
            self.sched.fail(unpack_error(packed))

    def cmd_stats(self):
        st = self.sched.stats()
        t = os.times()
        st["proxy_process_cpu_s"] = t.user + t.system
        return st

    def cmd_hook_break_qp(self, peer: int, qp: int):
        t = self.transport
        t.qps[(peer, qp)].qp.modify(t.api.QPAttr(qp_state=t.e.IBV_QPS_ERR), 0)

    def cmd_hook_drop_signal(self, peer: int, seq: int):
        sched = self.sched
        chunk_ops = sched._chunk_ops

        def without_signal(p, qp, k, nbytes, signaled):
            ops = chunk_ops(p, qp, k, nbytes, signaled)
            return ops[:-1] if p == peer and k == seq else ops

        sched._chunk_ops = without_signal

    def cmd_bench_null_pair(self, paths, slots: int, slot_bytes: int, qps: int):
        """benchmarks/bench_scheduler.py's process row: both ranks' schedulers over one null wire in this process
        (as its thread row has them in the benchmark's), on the rings mapped from ``paths``."""
        from triton_ep.transport.null import NullTransport, NullWire
        wire, n = NullWire(), RingLayout(2, slots, slot_bytes).nbytes
        self._maps = []
        for path in paths:
            with open(path, "r+b") as f:
                self._maps.append(mmap.mmap(f.fileno(), n))
        ts = [NullTransport(r, 2, wire, num_qps_per_peer=qps, timeout_s=60.0) for r in range(2)]
        self.pair = [ProxySweeps(t, slots=slots, slot_bytes=slot_bytes, memory=np.frombuffer(m, np.uint8))
                     for t, m in zip(ts, self._maps)]
        for x in self.pair:
            x.start([y.remote_region() for y in self.pair])
        self.sched = self.pair[0]       # (its error is reported; shutdown closes both)

    def cmd_modules(self):
        """The modules this process imported, and whether ``torch`` / ``triton`` are the real ones (a test's)."""
        tr = sys.modules.get("triton")
        return sorted(sys.modules), {"torch": sys.modules.get("torch") is not None,
                                     "triton": tr is not None and hasattr(tr, "__version__")}

    def cmd_close(self):
        self.shutdown(tell=True)

    def report(self, sock: socket.socket) -> None:
        """Send the scheduler's error to the rank, once."""
        if self.sched is not None and self.sched.error is not None and not self.reported:
            self.reported = True
            send_msg(sock, ("error", pack_error(self.sched.error)))

    def shutdown(self, tell: bool = False) -> None:
        """Stop the sweeps, close the transport (idempotent). ``tell``: the rank closes its Buffer (the ``close``
        command), so the peers get the scheduler's close words (:meth:`Scheduler.close
        <triton_ep.scheduler.Scheduler.close>`); not where the rank's process is gone (it did not close: it died)."""
        for x in getattr(self, "pair", ()):
            x.close()
        sched, transport = self.sched, self.transport
        self.sched = self.transport = None
        try:
            if sched is not None:
                sched.close(tell)
        finally:
            if transport is not None:
                transport.close()


def serve(fd: int, ppid: int, bell: Optional[int] = None) -> int:
    """The proxy process's loop: answer the rank's commands on the channel ``fd``, report the scheduler's error,
    and end when told to, when the channel ends or when the parent ``ppid`` is gone
    (:class:`triton_ep.transport.parent.ParentWatch`: its pidfd, and ``getppid()``, looked at every
    :data:`PARENT_POLL_S`; status :data:`PARENT_GONE_STATUS`). Returns the exit status (0: closed by the rank)."""
    sock = socket.socket(fileno=fd)
    parent = ParentWatch.of(ppid)
    served = _Served(bell)
    try:
        if parent.gone():
            return 3
        watch = [sock] + parent.fds()
        while True:
            readable, _, _ = select.select(watch, [], [], PARENT_POLL_S)
            if parent.gone(readable):
                return PARENT_GONE_STATUS
            if sock in readable:
                msg = recv_msg(sock)
                if msg is None:
                    return 5
                reply, done = served.handle(msg)
                send_msg(sock, reply)
                if done:
                    return 0
            served.report(sock)
    except (OSError, EPTimeoutError):
        return 6
    finally:
        served.shutdown()
        parent.close()
        sock.close()
