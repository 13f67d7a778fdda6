"""The :class:`Scheduler`: one rank's RDMA proxy over its rings (the package's docstring tells the protocol), its
set-up (region, QP plan, threads), its end (:meth:`Scheduler.close` drains first), and :func:`bootstrap`, which
connects a transport and starts one. Its parts live beside it: the host side of the rings (:mod:`.rings`), the proxy
threads' sweeps (:mod:`.sweep`), chunk posting (:mod:`.posting`), the counters (:mod:`.stats`)."""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_ep.transport.rdma import RemoteRegion, Transport, exchange_info, exchange_regions
from triton_ep.transport.ring_flags import RingFlags

from .faults import CLOSED, close_root, close_word, stage_code
from .layout import RingLayout, _PeerState, _QPState
from .liveness import probe_request
from .posting import ChunkPosting, is_probe_completion
from .rings import HostRings
from .stats import ProxyStats
from .sweep import ProxyThreads

#: seconds :meth:`Scheduler.close` waits at most for chunks published but not yet sent (:meth:`Scheduler.drain`)
DRAIN_S = 5.0
#: seconds :meth:`Scheduler.close` waits at most for its close words to complete (:meth:`Scheduler.tell_closing`)
CLOSE_WORD_S = 1.0


def _check_sizes(nq: int, slots: int, slot_bytes: int, wr_bytes: Optional[int], qps_per_channel: int) -> None:
    """A :class:`Scheduler`'s ring and QP sizes against each other and the transport's ``nq`` QPs per peer.

    Raises:
        ValueError: ``slots < 1``, ``slot_bytes`` no positive multiple of 64, ``wr_bytes < 1``, or
        ``qps_per_channel`` not dividing ``nq``.
    """
    if slots < 1 or slot_bytes < 64 or slot_bytes % 64:
        raise ValueError(f"slots must be >= 1 and slot_bytes a positive multiple of 64 (got {slots}, {slot_bytes})")
    if qps_per_channel < 1 or nq % qps_per_channel:
        raise ValueError(f"qps_per_channel {qps_per_channel} must divide the transport's {nq} QPs per peer")
    if wr_bytes is not None and wr_bytes < 1:
        raise ValueError(f"wr_bytes must be >= 1 (a WRITE below 64 bytes is raised to 64), got {wr_bytes}")


class Scheduler(HostRings, ProxyThreads, ChunkPosting, ProxyStats):
    """One rank's RDMA scheduler: rings, proxy threads, credits, completions.

    Args:
        transport: a connected :class:`~triton_ep.transport.rdma.Transport` (QPs to every peer in RTS).
        slots: S, ring slots per peer and direction (bounded rings: a producer waits for a free slot).
        slot_bytes: bytes per slot = the chunk size (a multiple of 64).
        wr_bytes: bytes per RDMA WRITE (a chunk is cut into WRITEs of at most this, at least 64; default: one
            WRITE a chunk, and the consecutive full chunks of a run one WRITE together, :meth:`_place_prepared`).
        qps_per_channel: QPs each channel owns per peer; channels = ``num_qps_per_peer // qps_per_channel``
            (channel ``c`` owns QP indices ``c * qps_per_channel ...``).
        proxies: proxy threads; thread ``t`` owns channels ``c % proxies == t``.  They share one lock (the
            transport is not thread-safe), so under the GIL more threads add structure, not speed.
        signal_every: signal one chunk of ``signal_every`` per QP (and the last of each chain).
        max_chunks_per_qp: chunks in flight per QP (default: a quarter of the send queue, at most 64).
        timeout_s: bound of every wait, seconds (default: the transport's).
        memory: host memory to put the region in (a contiguous uint8 CPU tensor or numpy array of at least
            ``layout.nbytes``: pinned, device-mapped host memory for GPU kernels); default: allocated and
            registered by the transport.
        on_signal: ``f(peer, qp, seq)`` called in the proxy thread when chunk ``seq``'s signal arrives, before
            the tail moves (tests look at the slot at that instant; with arrival words ``qp`` is None and the call
            comes when the proxy first sees the arrival word).
        arrival_words: signal each chunk with an arrival word (an RDMA WRITE into the peer's ``ARRIVE`` word, after
            the data on the same QP) instead of a WRITE_WITH_IMM: two work requests a chunk of one WRITE, no
            receive completion at the peer (``flags.ring_arrive_word``).
        trace: keep ``(t_ns, kind, peer, channel, qp, seq, bytes)`` events in :attr:`events`.
        cpu_split: also read the thread's CPU clock around every transport call, for ``proxy_transport_cpu_s`` in
            :meth:`stats` (two system calls of about 1 µs each per call, paid by the proxy; default: the
            environment variable ``TRITON_EP_PROXY_CPU_SPLIT`` is ``1``; otherwise that figure stays 0).
    Raises:
        ValueError: bad sizes (``slots``, ``slot_bytes``, ``wr_bytes``, ``qps_per_channel``).  RdmaError:
            registration failed.
    """

    def __init__(self, transport: Transport, *, slots: int = 8, slot_bytes: int = 1 << 20,
                 wr_bytes: Optional[int] = None, qps_per_channel: int = 1, proxies: int = 1, signal_every: int = 4,
                 max_chunks_per_qp: Optional[int] = None, timeout_s: Optional[float] = None, memory=None,
                 on_signal: Optional[Callable[[int, int, int], None]] = None, trace: bool = False,
                 arrival_words: bool = False, cpu_split: Optional[bool] = None) -> None:
        nq = transport.num_qps_per_peer
        _check_sizes(nq, slots, slot_bytes, wr_bytes, qps_per_channel)
        self.t = transport
        self.rank, self.world = transport.rank, transport.world_size
        self.layout = RingLayout(self.world, slots, slot_bytes)
        self.slots, self.slot_bytes = slots, slot_bytes
        self.wr_bytes = slot_bytes if wr_bytes is None else max(64, wr_bytes)
        #: consecutive full chunks of a run in consecutive slots go as one WRITE (``wr_bytes`` left to its default:
        #: no bound on a WRITE's bytes was asked for; :meth:`_place_prepared`)
        self._merge_runs = wr_bytes is None
        self.qps_per_channel = qps_per_channel
        self.channels = nq // qps_per_channel
        self.proxies = max(1, min(proxies, self.channels))
        self.signal_every = max(1, signal_every)
        sq = int(getattr(transport, "sq_depth", 256))
        self.max_chunks_per_qp = max_chunks_per_qp or max(1, min(64, sq // 4))
        self.timeout_s = float(transport.timeout_s if timeout_s is None else timeout_s)
        self.on_signal, self.trace = on_signal, trace
        self.events: List[tuple] = []
        self.arrival_words = bool(arrival_words)
        self._init_region(memory)
        self.peers = transport.peer_ranks()     # (the ranks it has QPs to: every other one, or a subset)
        self._remote: Dict[int, RemoteRegion] = {}
        self._peer = {p: _PeerState() for p in self.peers}
        self._peer_list = list(self._peer.items())     # (the sweep's loops: no dict look-up per peer)
        self._next_tx = {p: 0 for p in self.peers}      # the next chunk numbers (:meth:`reserve`)
        self._next_rx = {p: 0 for p in self.peers}
        self._qps: Dict[Tuple[int, int], _QPState] = {}
        self._ports: Dict[str, List[int]] = collections.defaultdict(lambda: [0, 0])   # [outstanding, total]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self.error: Optional[BaseException] = None
        self._init_statistics(cpu_split)
        self._init_posting()
        self._init_sweep()
        #: the stage of the host wait in progress (:meth:`wait_stage`), or None
        self.waiting: Optional[str] = None
        #: ``f(peer)``, called once where this scheduler fails because rank ``peer`` is gone (:class:`PeerGoneError`),
        #: from the thread that failed it: a mode's kernels that wait for that peer elsewhere than in the rings
        #: (low-latency across hosts) end their waits (their ``DEAD`` word). Must not raise.
        self.on_gone: Optional[Callable[[int], None]] = None

    # ---------------------------------------------------------------- set-up
    def _init_region(self, memory) -> None:
        """The rings' region: ``memory`` (else memory the transport allocates) registered and zeroed, and the control
        words over it (:class:`~triton_ep.transport.ring_flags.RingFlags`). Raises ValueError where ``memory`` holds
        fewer bytes than the layout needs."""
        n = self.layout.nbytes
        if memory is not None and memory.nbytes < n:
            raise ValueError(f"memory holds fewer than the {n} bytes the rings need")
        self.region = self.t.register(n if memory is None else memory)
        self.mem = self.region.view()[:n]
        self.mem[:] = 0
        self.flags = RingFlags(self.mem[:self.layout.ctrl_bytes].view(np.int64), self.rank, self.world, self.slots)

    def remote_region(self) -> RemoteRegion:
        """This rank's region as peers need it (address, length, rkeys); exchange it, then :meth:`start`."""
        return self.region.remote()

    def start(self, remotes: Sequence[RemoteRegion]) -> "Scheduler":
        """Start the proxy threads, given every rank's :meth:`remote_region` (index = rank)."""
        self._remote = {p: remotes[p] for p in self.peers}
        self._plan_qps()
        self._prepare_wrs()
        for i in range(self.proxies):
            own = [q for q in self._qps.values() if q.owner == i]
            th = threading.Thread(target=self._run, args=(own,), name=f"triton-ep-proxy-{self.rank}.{i}", daemon=True)
            self._threads.append(th)
            th.start()
        return self

    def _plan_qps(self) -> None:
        """The QPs' states from the transport's placement (port, channel, owning proxy thread), their
        receive queues filled, and the QP picker's lists of QPs with room."""
        for p in self.peers:
            for ent in self.t.placement(p):
                port = f"{ent.port.device}:{ent.port.port}" + (f"/lag{ent.port.lag_port}" if ent.port.lag_port else "")
                self._qps[(p, ent.qp)] = _QPState(p, ent.qp, ent.qp // self.qps_per_channel, port)
                if self._replenish:
                    self.t.post_recv(p, ent.qp, int(getattr(self.t, "rq_depth", 64)))
        for q in self._qps.values():
            q.owner = q.channel % self.proxies
            q.room = self._rooms.setdefault((q.owner, q.peer), {}).setdefault(q.port, [])
            q.port_w = self._ports[q.port]
            q.room.append(q)
            q.peer_state, q.i_sent = self._peer[q.peer], self._i_sent[q.peer]
        #: per (proxy thread, peer): its ports' ``(QPs with room, [outstanding, total])``, for the picker
        self._picks = {k: [(room, self._ports[port]) for port, room in ports.items()]
                       for k, ports in self._rooms.items()}

    def close(self, tell: bool = True) -> None:
        """Let the proxy finish what was published (:meth:`drain`), then stop and join the proxy threads, and with
        ``tell`` (the rank closes, alive) write the peers its close word (:meth:`tell_closing`); idempotent. The
        transport (QPs, MRs, CQs, PD) is the caller's: close it after this."""
        self.drain(min(self.timeout_s, DRAIN_S))
        self._stop.set()
        for th in self._threads:
            th.join(timeout=self.timeout_s + 5.0)
        started, self._threads = bool(self._threads), []
        if started and tell:
            self.tell_closing(min(self.timeout_s, CLOSE_WORD_S))

    def tell_closing(self, bound_s: float) -> None:
        """With the proxy threads stopped: where this proxy wrote no fault word, write a close word
        (:func:`~.faults.close_word`: the rank its error named, if any, and how that rank left:
        :func:`~.faults.close_root`) into the ``FAULT`` slot of each peer that is not masked and has not closed itself
        (its close word here), with the liveness probe's request (QP 0: after everything this rank sent it), and wait
        at most ``bound_s`` for those requests to complete, so the words are placed before the QPs go. Never raises
        (a peer that cannot take it is ended anyway)."""
        if self.flags.get(RingFlags.SRC, self.rank):
            return                  # (its fault word told them)
        ex = self.error
        root, how = close_root(ex, self.rank)
        self.flags.put(RingFlags.SRC, self.rank, close_word(stage_code(ex), root, how))
        want = {}
        for p in self.peers:
            if self.flags.masked(p) or self.flags.get(RingFlags.FAULT, p) & CLOSED or p == root:
                continue
            try:
                self.t.post_prepared(p, 0, probe_request(p))
            except Exception:   # noqa: BLE001  (a QP in the error state: nothing reaches that peer)
                continue
            want[p] = 1 + (p in self.liveness.probing)     # (a probe before it completes first)
        end = time.monotonic() + bound_s
        while want and time.monotonic() < end:
            try:
                comps = self.t.poll(raise_on_error=False)
            except Exception:   # noqa: BLE001
                return
            for c in comps:
                p = c.peer if is_probe_completion(c) else None
                if p in want:
                    want[p] -= 1
                    if want[p] <= 0:
                        del want[p]
            if not comps:
                time.sleep(0.0002)

    def drain(self, bound_s: float) -> bool:
        """Wait, at most ``bound_s`` seconds, until every chunk published to a peer that is not masked was posted
        and its send completed (``SENT`` reached ``READY``): a rank that returns from its last call and destroys
        its Buffer must not take its QPs away under writes still queued or in flight to a slower peer (the
        peer would find it gone, or wait out its bound). Returns at once where the proxy failed or is not
        running. Returns whether everything was sent."""
        end = time.monotonic() + bound_s
        while self.error is None and any(th.is_alive() for th in self._threads):
            if all(self.flags.get(RingFlags.SENT, p) >= self.flags.get(RingFlags.READY, p)
                   for p in self.peers if not self.flags.masked(p)):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.0005)
        return self.error is None

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bootstrap(transport: Transport, sched_kwargs: Optional[dict] = None, group=None) -> Scheduler:
    """Connect ``transport`` to every peer and start a :class:`Scheduler` on it, exchanging QP infos and
    regions through the group's store (bounded by the scheduler's ``timeout_s``, nothing left pending:
    :mod:`triton_ep.transport.bootstrap`; ``group``: default group).  Returns the started scheduler."""
    peers = transport.peer_ranks()
    timeout_s = (sched_kwargs or {}).get("timeout_s")
    timeout_s = float(timeout_s if timeout_s is not None else getattr(transport, "timeout_s", 100.0))
    remote = exchange_info({p: transport.local_info(p) for p in peers}, group, timeout_s)
    for p in peers:
        transport.connect(p, remote[p])
    sched = Scheduler(transport, **(sched_kwargs or {}))
    return sched.start(exchange_regions(sched.remote_region(), group, timeout_s))
