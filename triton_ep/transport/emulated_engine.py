"""The emulated HCA of one process (:mod:`triton_ep.transport.emulated`): the progress thread that executes the
posted work queue entries, drains the inbound rings and answers requests, the rate model that charges their bytes
in virtual time, and the CPU time the posts cost (:func:`nic_cpu_s`)."""
from __future__ import annotations

import collections
import errno as _errno
import os
import random
import threading
import time
from typing import Dict, List, Optional, Tuple

from triton_ep.transport.emulated_api import PyverbsRDMAError
from triton_ep.transport.emulated_ring import _ACK, _Ring


#: seconds between a requester's looks at whether the QPs it has requests outstanding at still exist (their
#: process's lock on the ring file)
PEER_LOOK_S = 0.05


class RateModel:
    """Virtual-time bandwidth model: busy-until per resource (sending port, path, receiving port, QP).

    A request of ``n`` bytes starts when its QP, its sending port, its path and the receiving port are all
    free (never before ``t0``); it occupies each resource for ``n / bandwidth`` and finishes after
    ``n / min(bandwidths)``.  Units: bytes, bytes per second, seconds.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget all traffic: virtual time restarts at 0."""
        self.free: Dict[tuple, float] = collections.defaultdict(float)
        self.bytes: Dict[tuple, int] = collections.defaultdict(int)
        self.end = 0.0

    def charge(self, qp_key: tuple, resources: List[Tuple[tuple, float]], nbytes: int, t0: float = 0.0) -> float:
        """Charge ``nbytes`` to ``resources`` ([(key, bytes/s)]) after ``qp_key``'s previous request; returns end.
        A zero-byte request is ordered after its QP's previous one and occupies no resource."""
        with self.lock:
            if nbytes <= 0:      # a zero-length request (a bare WRITE_WITH_IMM) holds no link, only its QP's order
                end = self.free[qp_key] = max(t0, self.free[qp_key])
                self.end = max(self.end, end)
                return end
            start = max([t0, self.free[qp_key]] + [self.free[k] for k, _ in resources])
            slowest = min(bw for _, bw in resources)
            for k, bw in resources:
                self.free[k] = start + nbytes / bw
                self.bytes[k] += nbytes
            end = start + nbytes / slowest
            self.free[qp_key] = end
            self.end = max(self.end, end)
            return end

    def makespan(self) -> float:
        """Virtual time at which the last charged request finished (seconds)."""
        return self.end


class _Engine:
    """Per-process, per-fabric state and the progress thread that plays the HCAs' part."""
    _by_token: Dict[str, "_Engine"] = {}
    _glock = threading.Lock()

    @classmethod
    def get(cls, fabric: "Fabric") -> "_Engine":
        with cls._glock:
            eng = cls._by_token.get(fabric.token)
            if eng is None or eng.pid != os.getpid():
                eng = cls._by_token[fabric.token] = _Engine(fabric)
            return eng

    def __init__(self, fabric: "Fabric") -> None:
        self.fabric, self.pid = fabric, os.getpid()
        self.lock = threading.RLock()
        self.model = RateModel()
        self.qps: Dict[int, "QP"] = {}
        self.mrs: Dict[int, "MR"] = {}
        self.out_rings: Dict[int, _Ring] = {}
        self.qpn_next: Dict[int, int] = collections.defaultdict(lambda: 1)
        self.key_next = 0x100
        self.rng = random.Random(fabric.spec.reorder_seed)
        self.kick = threading.Event()
        #: QPs whose doorbell rang (:meth:`ring_doorbell`): the progress thread executes their work queue entries
        self.rung: collections.deque = collections.deque()
        self.thread: Optional[threading.Thread] = None
        #: (responder qpn, requester seq) of the latest placements, in placement order (for tests)
        self.placements: collections.deque = collections.deque(maxlen=1 << 16)

    def path(self, qpn: int) -> str:
        return f"{self.fabric.ring_prefix}{qpn:06x}"

    def release_if_idle(self) -> None:
        """With no QP left in this process: unmap the peers' rings (each mapping holds a descriptor) and
        wait for the progress thread to stop (it stops by itself once idle without QPs)."""
        with self.lock:
            if self.qps:
                return
            rings, self.out_rings = list(self.out_rings.values()), {}
            thread = self.thread
        for r in rings:
            r.close(unlink=False)
        if thread is not None and thread is not threading.current_thread():
            self.kick.set()
            thread.join(timeout=5.0)

    def start(self) -> None:
        """Start the progress thread unless it runs."""
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="emulated-hca", daemon=True)
                self.thread.start()

    def new_qpn(self, dev_index: int) -> int:
        with self.lock:
            n = self.qpn_next[dev_index]
            self.qpn_next[dev_index] += 1
            if n >= 0x1000:
                raise PyverbsRDMAError("Failed to create QP: too many emulated QPs", _errno.ENOMEM)
            return ((dev_index + 1) << 12) | n

    def new_key(self) -> int:
        with self.lock:
            self.key_next += 0x101
            return self.key_next

    def out_ring(self, qpn: int) -> _Ring:
        r = self.out_rings.get(qpn)
        if r is None:
            own = self.qps.get(qpn)
            r = own.ring if own is not None else _Ring(self.path(qpn), self.fabric.spec.ring_bytes, create=False)
            self.out_rings[qpn] = r
        return r

    def send(self, qpn: int, rec: bytes, timeout_s: float = 60.0) -> None:
        """Put ``rec`` into QP ``qpn``'s inbound ring (outside the engine lock); dropped where that QP is gone
        (:meth:`_Ring.put`: its requester sees no ACK)."""
        self.out_ring(qpn).put(rec, self.drain, time.monotonic() + timeout_s)
        self.kick.set()

    def look_at_peer(self, qp: "QP", now: float) -> None:
        """Every :data:`PEER_LOOK_S` while ``qp`` has requests outstanding: where the QP they went to is gone (its
        process's lock on its ring released), they are lost from now on (:meth:`QP._lost` fails the oldest after
        the retry time). Called by the progress thread, under the engine lock."""
        if now < qp.peer_look_at or qp.peer_gone or qp.dst is None:
            return
        qp.peer_look_at = now + PEER_LOOK_S
        ring = self.out_rings.get(qp.dest_qpn)
        if ring is not None and not ring.consumer_alive():
            qp.peer_gone = True
            if qp.outstanding:
                qp.lost_since = qp.lost_since or now

    def ring_doorbell(self, qp: "QP") -> None:
        """``qp`` has work queue entries to execute (:meth:`QP.post_send`): wake the progress thread."""
        self.rung.append(qp)
        if not self.kick.is_set():
            self.kick.set()

    # ---- progress
    def execute(self) -> bool:
        """Execute the work queue entries of every QP whose doorbell rang, in post order per QP (each under the
        engine lock, its records sent outside it); returns whether there were any."""
        rung, did = self.rung, False
        while rung:
            qp = rung.popleft()
            bell = qp.doorbell
            while bell:
                with self.lock:
                    if not bell:        # (a RESET emptied it)
                        break
                    recs = qp._start(bell.popleft())
                did = True
                for rec in recs:
                    self.send(qp.dest_qpn, rec)
        return did

    def drain(self) -> None:
        """Move every inbound record into its QP's pending queue (never blocks)."""
        with self.lock:
            now = time.monotonic()
            for qp in list(self.qps.values()):
                if qp.ring is None:
                    continue
                for rec in qp.ring.drain():
                    if rec[0] == _ACK:
                        qp.acks.append(rec)
                        continue
                    spec, hold = self.fabric.spec, now
                    if spec.reorder_seed is not None:
                        hold += self.rng.random() * spec.reorder_max_s
                    if spec.skew_s and qp.qp_num % 2 == 0:
                        hold += spec.skew_s
                    if hold != now:
                        hold = qp.last_hold = max(qp.last_hold, hold)
                    qp.pending.append([hold, rec])

    def step(self) -> bool:
        """One pass: execute posted requests, drain, then handle every ready record; returns whether anything
        happened."""
        did = self.execute()
        self.drain()
        outgoing: List[Tuple[int, bytes]] = []
        with self.lock:
            now = time.monotonic()
            for qp in list(self.qps.values()):
                if qp.outstanding:
                    self.look_at_peer(qp, now)
                qp._lost(now)
                while qp.acks:
                    qp._on_ack(qp.acks.popleft())
                    did = True
                while qp.pending and qp.pending[0][0] <= now:
                    rec = qp.pending[0][1]
                    res = qp._on_request(rec, now)
                    if res is None:          # waiting (RNR / not yet RTR): keep order, retry later
                        break
                    qp.pending.popleft()
                    did = True
                    if res:
                        outgoing.append(res)
        for qpn, rec in outgoing:
            self.send(qpn, rec)
        return did

    def _run(self) -> None:
        idle = 0
        while True:
            self.kick.clear()       # (before the step: a doorbell rung during it ends the wait below at once)
            try:
                did = self.step()
            except Exception as ex:  # keep the emulated HCA alive; surface through the QPs
                with self.lock:
                    for qp in self.qps.values():
                        qp.async_error = qp.async_error or repr(ex)
                did = False
            if did:
                idle = 0
                continue
            idle = min(idle + 1, 20)
            if idle == 20:
                with self.lock:
                    if not self.qps:        # nothing left to serve: stop; the next QP restarts the thread
                        self.thread = None
                        return
            self.kick.wait(0.00005 * idle)


#: CPU nanoseconds this process's threads spent inside the emulated NIC's posts (:func:`nic_cpu_s`)
_nic_cpu = [0]
_nic_cpu_lock = threading.Lock()


def _counting_nic_cpu(fn, *args) -> None:
    """``fn(*args)`` (a post), its CPU time counted in :func:`nic_cpu_s`."""
    c0 = time.thread_time_ns()
    try:
        fn(*args)
    finally:
        dt = time.thread_time_ns() - c0
        with _nic_cpu_lock:
            _nic_cpu[0] += dt


def nic_cpu_s() -> float:
    """CPU seconds this process's threads have spent inside the emulated NIC's ``post_send`` and ``post_recv``, since
    the process started: the doorbells (a work queue entry per request; the payload copies, records and rate model
    are the progress thread's, never the poster's) and the receives posted.

    Benchmarks subtract it from a proxy's CPU time to get the proxy's own cost (on a NIC a post is a doorbell write;
    the emulator's completions, polled by the proxy, are not counted here and stay in the proxy's figure). The two
    clock reads around each post are counted here too."""
    return _nic_cpu[0] / 1e9
