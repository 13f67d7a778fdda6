"""What the proxy counts (:meth:`ProxyStats.stats`): work requests, probes, busy sweeps, and the nanoseconds of its
sweeps, of its transport calls and of its data posts, in wall clock and CPU time; and its trace events."""
from __future__ import annotations

import os
import time
from typing import Optional, Tuple


class ProxyStats:
    """The :class:`~triton_ep.scheduler.Scheduler`'s counters (a part of it: its state is the scheduler's)."""

    def _init_statistics(self, cpu_split: Optional[bool]) -> None:
        """The counters :meth:`stats` reports, all zero (``cpu_split``: also split the CPU time inside transport
        calls out; ``None``: ``TRITON_EP_PROXY_CPU_SPLIT=1``)."""
        self._t0 = time.perf_counter_ns()
        self.wrs_posted = 0
        #: liveness probes posted (:meth:`_probe`; not in ``wrs_posted``, which counts the data path's requests)
        self.probes_posted = 0
        # The statistics are plain integers, nanoseconds, added to in the sweeps and folded into seconds only by
        # stats(). Nanoseconds the proxy threads spent in sweeps that moved something (wall clock: with the GIL
        # waits of a busy process), the part of it inside the transport's data posts, and the proxy threads' CPU
        # nanoseconds in those sweeps (no GIL waits; the thread's CPU clock is read once per pass: _run).
        self._busy_ns = self._post_ns = self._busy_cpu_ns = 0
        # Of _busy_ns: nanoseconds inside every transport call (polls, posts, credits, receive replenishes: on a
        # NIC, pyverbs calls; over the emulated fabric, the emulator's Python as well); with cpu_split, of
        # _busy_cpu_ns the CPU nanoseconds inside them (else 0: the two CPU-clock reads per call cost more than a
        # chunk's own bookkeeping).
        self._transport_ns = self._transport_cpu_ns = 0
        if cpu_split is None:
            cpu_split = os.environ.get("TRITON_EP_PROXY_CPU_SPLIT", "").strip() == "1"
        self._cpu_split = bool(cpu_split)
        #: sweeps that moved something
        self.busy_sweeps = 0
        self._sweep_tx_ns = self._sweep_tx_cpu_ns = 0

    def stats(self) -> dict:
        """Bytes, WRs and chunks per QP (``"peer/qp"`` keys, with channel and port), bytes per port, work
        requests posted, ``proxy_busy_s``: seconds (wall clock) the proxy threads spent in sweeps that moved
        something, ``proxy_post_s``: the part of those inside the transport's data posts (a doorbell on a NIC and
        on the emulated fabric, whose progress thread copies the payloads), ``proxy_transport_s``: the part inside any
        transport call (polls, posts, credits, receive replenishes), ``proxy_cpu_s``: the proxy threads'
        CPU seconds in those sweeps (``proxy_busy_s`` less the time they waited, e.g. for the GIL),
        ``proxy_transport_cpu_s``: the part of those inside transport calls (``proxy_cpu_s -
        proxy_transport_cpu_s`` is the scheduler's own Python in CPU time; 0 unless ``cpu_split``), and
        ``proxy_busy_sweeps``: how many such sweeps. The sweeps count nanoseconds as integers; this folds them."""
        with self._lock:
            qps = {f"{q.peer}/{q.qp}": dict(channel=q.channel, port=q.port, bytes=q.total_bytes, wrs=q.wrs,
                                            chunks=q.chunks) for q in self._qps.values()}
            ports = {k: v[1] for k, v in self._ports.items()}
            ns = (self._busy_ns, self._post_ns, self._transport_ns, self._busy_cpu_ns, self._transport_cpu_ns)
        busy, post, tx, cpu, tx_cpu = (v / 1e9 for v in ns)
        return {"qps": qps, "ports": ports, "wrs": self.wrs_posted, "probes": self.probes_posted, "proxy_busy_s": busy, "proxy_post_s": post,
                "proxy_transport_s": tx, "proxy_cpu_s": cpu, "proxy_transport_cpu_s": tx_cpu,
                "proxy_busy_sweeps": self.busy_sweeps}

    @property
    def busy_s(self) -> float:
        """Seconds (wall clock) the proxy threads spent in sweeps that moved something (``stats()["proxy_busy_s"]``)."""
        return self._busy_ns / 1e9

    # ---------------------------------------------------------------- the proxy
    def _event(self, kind: str, peer, channel, qp, seq, nbytes) -> None:
        self.events.append((time.perf_counter_ns() - self._t0, kind, peer, channel, qp, seq, nbytes))

    def _tx_begin(self) -> Tuple[int, int]:
        """``(perf_counter_ns, thread_time_ns or 0)`` before a transport call (the CPU clock only with
        ``cpu_split``)."""
        return time.perf_counter_ns(), (time.thread_time_ns() if self._cpu_split else 0)

    def _tx_done(self, t0: int, c0: int) -> int:
        """A transport call that began at ``(t0, c0)`` (:meth:`_tx_begin`) returned: its wall (and with
        ``cpu_split`` CPU) nanoseconds count as the sweep's transport time.  Returns the wall nanoseconds."""
        if self._cpu_split:
            self._sweep_tx_cpu_ns += time.thread_time_ns() - c0    # (read inside the wall-clock interval)
        dt = time.perf_counter_ns() - t0
        self._sweep_tx_ns += dt
