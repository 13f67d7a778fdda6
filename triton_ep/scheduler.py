"""The RDMA scheduler: a per-rank proxy that moves chunks between hosts over multi-channel, multi-QP RDMA.

Each rank has one registered region (:class:`RingLayout`): a control block of int64 chunk counters
(``flags.RING_*``; host side :class:`~triton_ep.transport.signals.RingFlags`), a send ring and a receive
ring of ``slots`` slots of ``slot_bytes`` per peer.  Chunk ``k`` for peer ``p`` lives in send slot
``k % slots`` here and lands in receive slot ``k % slots`` (of this rank's ring) at ``p``.

- A **producer** (a Triton kernel, or host code) waits until ``SENT[p] > k - slots`` (the slot's earlier
  chunk is placed at the peer), writes chunk ``k`` and its length (``LEN``), then releases
  ``READY[p] = k + 1``.
- The **proxy** (one or more threads, each owning some channels) polls ``READY``.  A chunk may go once the
  peer has room for it (``k - CREDIT[p] < slots``).  It picks the port with the fewest bytes posted so far
  (then the least outstanding bytes on the port and on the QP), among its channels' QPs to ``p`` (the
  transport placed them over ports and ECMP paths by the topology plan), and posts the chunk's RDMA WRITEs and then its signal, a
  WRITE_WITH_IMM carrying ``k`` in the immediate, **on the same QP**: RC ordering places the data before the
  receive completion of the signal, with no fence. The signal is the chunk's last WRITE itself (a
  WRITE_WITH_IMM carries data), so a chunk of one WRITE is one work request.  A QP's chunks are posted as one chain
  per sweep; only every ``signal_every``-th signal, and the last of a chain, is signalled; a completion
  retires every earlier chunk of that QP.  Retired chunks advance ``SENT``.
- The receiving proxy turns receive completions (WRITE_WITH_IMM) into ``TAIL[p]``, the count of chunks
  arrived in order (chunks on different QPs may arrive out of order; the tail waits for the gap), which a
  consumer (kernel or host) acquires.  A consumer frees slots by releasing ``HEAD[p]``; the proxy writes
  the head into the peer's ``CREDIT`` word lazily (when half a ring is freed, or the consumer caught up),
  always on QP 0 of that peer so credits land in order.
- With **arrival words** (``arrival_words=True``; low-latency mode across hosts) a chunk's signal is a plain RDMA
  WRITE of the word ``k + 1`` into the peer's ``ARRIVE`` word of the chunk's receive slot, posted after the
  chunk's data on the same QP (in-QP ordering places the data first): a consumer polls that word, so the
  receiving proxy is not on the chunk's path (no receive completion, no receive to post again). The receiving
  proxy still moves ``TAIL`` from the arrival words it sees (host consumers, credits and masking use it).

**Liveness probes.** Every :data:`PROBE_S` the proxy posts to each peer (not masked) one signalled 8-byte RDMA WRITE
on QP 0: this rank's fault word (0 while it is healthy) into the peer's ``FAULT[me]`` word, where a failing proxy
writes it anyway (:meth:`Scheduler.fail`). The peer's NIC acknowledges it without the peer's CPU, so a peer busy
compiling or starved of the GIL is never taken for dead. A peer whose process is gone has no QPs left (the kernel
destroys them with the process; a NIC drops packets for a QP that does not exist), so the probe, like any request
to it, completes with ``IBV_WC_RETRY_EXC_ERR`` after the QP's retries (``retry_cnt`` + 1 local ACK timeouts: 0.54 s
at ``timeout`` 14, ``retry_cnt`` 7); the same status comes when its host or the path to it is down. A probe (or any
request on QP 0) that completes so is a :class:`PeerGoneError` naming that peer, which this proxy's fault word
carries to its other peers (they raise ``PeerGoneError`` naming the same rank). A request on another QP that
completes so may mean that only that QP failed (a responder QP in the error state drops packets too): the next
probe, posted at once, decides: acknowledged, it is a :class:`ProxyError` naming that QP; not, ``PeerGoneError``. Where a peer is alive but stuck, nothing fails
here: ``timeout_s`` stays the bound.

Every wait is bounded by ``timeout_s``.  A proxy that fails (a QP in the error state, an error completion,
a chunk not completed within the bound, a peer that stops consuming) records a :class:`ProxyError` naming
rank, peer, channel, QP and stage, sets the abort word (kernels' waits end), and writes a fault word into
every peer's ``FAULT`` slot over RDMA, so the peers raise :class:`ProxyRemoteError` at once.  A peer that
stops producing is seen by the consumers' waits (:class:`~triton_ep.errors.EPTimeoutError`).

The scheduler talks only to :class:`triton_ep.transport.rdma.Transport`: the pyverbs backend and the
emulated fabric are interchangeable.  Verbs names: QP (queue pair), CQ (completion queue), MR (memory
region), PD (protection domain), rkey (the remote key in :class:`~triton_ep.transport.rdma.RemoteRegion`).
"""
from __future__ import annotations

import collections
import heapq
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from triton_ep.errors import EPError, EPRemoteError, EPTimeoutError
from triton_ep.protocol import signal_header as F
from triton_ep.transport.rdma import (WRITE, WRITE_WITH_IMM, Completion, Op, RemoteRegion, Transport, exchange_info,
                                      exchange_regions)
from triton_ep.transport.ring_flags import RingFlags

#: wr_id tag of a chunk's signal (the low bits hold the chunk number)
TAG_CHUNK = 1 << 60
#: wr_id tag of a liveness probe (:meth:`Scheduler._probe`; the low bits hold the peer)
TAG_PROBE = 1 << 59
#: seconds :meth:`Scheduler.close` waits at most for chunks published but not yet sent (:meth:`Scheduler.drain`)
DRAIN_S = 5.0
#: seconds between two liveness probes to a peer (one at a time per peer)
PROBE_S = 0.2
#: the completion status of a request that the peer's QP never acknowledged (retries exhausted): the peer is gone
STATUS_GONE = "IBV_WC_RETRY_EXC_ERR"
_SEQ_MASK = (1 << 48) - 1

#: stages a proxy error names (also carried in fault words): codes and names from the protocol's one table
STAGE_POST, STAGE_SEND_CQE, STAGE_RECV_CQE = F.STAGE_PROXY_POST, F.STAGE_PROXY_SEND_CQE, F.STAGE_PROXY_RECV_CQE
STAGE_CREDIT, STAGE_SEND_WAIT, STAGE_INTERNAL = F.STAGE_PROXY_CREDIT, F.STAGE_PROXY_SEND_WAIT, F.STAGE_PROXY
STAGE_NAMES = F.STAGE_NAMES

if sys.argv[:1] == ["-m"]:
    # ``python -m triton_ep.scheduler`` (argv[0] is "-m" while runpy finds the module): the package imports this
    # module before runpy runs it again as __main__, and runpy warns of that; the __main__ copy only hands over to
    # triton_ep.scheduler_cli, which uses this one, so the warning has nothing to say
    warnings.filterwarnings("ignore", message=r"'triton_ep\.scheduler' found in sys\.modules",
                            category=RuntimeWarning)


def is_chunk_signal(op: Op) -> bool:
    """Whether ``op`` is a chunk's signal (its WRITE_WITH_IMM, or with arrival words its arrival-word WRITE): the
    work request whose ``wr_id`` carries :data:`TAG_CHUNK` and the chunk number. Test hooks that move or drop a
    chunk's signal pick it with this."""
    return op.wr_id is not None and bool(op.wr_id & TAG_CHUNK)


def fault_word(stage: int, channel: Optional[int], qp: Optional[int], gone: Optional[int] = None) -> int:
    """The 64-bit word a failed proxy writes into each peer's ``FAULT`` slot: bit 62 set, the stage in
    bits 40..47, channel + 1 in 24..39 and QP + 1 in 8..23 (0: none); where it failed because a peer is gone
    (:class:`PeerGoneError`), that peer's rank + 1 in bits 48..61 (:func:`fault_gone`)."""
    ch = 0 if channel is None else channel + 1
    q = 0 if qp is None else qp + 1
    g = 0 if gone is None else gone + 1
    return (1 << 62) | (g << 48) | (stage << 40) | (ch << 24) | (q << 8)


def fault_gone(word: int) -> Optional[int]:
    """The rank a :func:`fault_word` says is gone, or ``None``."""
    g = (word >> 48) & 0x3FFF
    return g - 1 if g else None


def parse_fault(word: int) -> Tuple[int, Optional[int], Optional[int]]:
    """``(stage, channel, qp)`` of a :func:`fault_word` (channel / QP ``None`` where it named none)."""
    ch, q = (word >> 24) & 0xFFFF, (word >> 8) & 0xFFFF
    return (word >> 40) & 0xFF, (ch - 1 if ch else None), (q - 1 if q else None)


class ProxyError(EPError):
    """The RDMA proxy of ``rank`` failed: the peer, channel and QP index (towards that peer) concerned, the
    stage, and why (a completion status, a verbs error, a bound that passed).  Each may be ``None``."""

    def __init__(self, rank: int, peer: Optional[int], channel: Optional[int], qp: Optional[int], stage: str,
                 why: str) -> None:
        self.rank, self.peer, self.channel, self.qp, self.stage, self.why = rank, peer, channel, qp, stage, why
        where = ", ".join(f"{k} {v}" for k, v in (("peer", peer), ("channel", channel), ("QP", qp)) if v is not None)
        super().__init__(f"triton-ep scheduler: rank {rank} failed at stage '{stage}' ({where or 'no peer'}): {why}")


class ProxyRemoteError(ProxyError, EPRemoteError):
    """A peer's proxy failed and said so (its fault word); ``peer``/``channel``/``qp``/``stage`` are its."""


class PeerGoneError(ProxyError, EPRemoteError):
    """Rank ``peer`` is gone: a work request to it completed with ``IBV_WC_RETRY_EXC_ERR`` (its QP never
    acknowledged it within the QP's retries: its process ended and its QPs with it, or its host or the path to it
    is down), seen by this proxy (``told_by`` None; ``channel``/``qp``: the QP) or by peer ``told_by``, whose fault
    word named it. ``stage``: where this rank waited when it learnt of it (:meth:`Scheduler.check` fills it in
    from the ring's record or the host wait; until then the proxy's stage). ``failed_rank`` and ``dead_ranks``
    (``[peer]``) name the gone rank as :func:`triton_ep.transport.liveness.dead_error` does within a host. Ranks are
    the scheduler's (its transport's) until the mode renames them (:meth:`renamed`)."""

    def __init__(self, rank: int, peer: int, channel: Optional[int], qp: Optional[int], stage: str, why: str,
                 told_by: Optional[int] = None, placed: bool = False) -> None:
        self.rank, self.peer, self.channel, self.qp, self.stage, self.why = rank, peer, channel, qp, stage, why
        self.failed_rank, self.dead_ranks, self.told_by, self.placed = peer, [peer], told_by, placed
        heard = "" if told_by is None else f"; rank {told_by} found it and told this rank"
        EPError.__init__(self, f"triton-ep: rank {rank}: rank {peer}'s process is gone or its host is unreachable "
                               f"({why}{heard}) while this rank waited at stage '{stage}'; this call's outputs here "
                               f"are not valid; destroy() and rebuild the Buffer")

    def renamed(self, rank: int, peer: int, told_by: Optional[int], where: str = "",
                stage: Optional[str] = None) -> "PeerGoneError":
        """The same error with other rank numbers (the mode's: global ranks), ``where`` added to the reason and
        (given) another ``stage``."""
        return PeerGoneError(rank, peer, self.channel, self.qp, self.stage if stage is None else stage,
                             f"{self.why}; {where}" if where else self.why, told_by, self.placed)


def placed_error(ex: BaseException, stage: Optional[str]) -> BaseException:
    """``ex``, where it is a :class:`PeerGoneError` not yet placed, at the stage this rank waited at (``stage``:
    :meth:`Scheduler.wait_stage`; ``None``: the proxy's stage stays)."""
    if not isinstance(ex, PeerGoneError) or ex.placed:
        return ex
    out = ex.renamed(ex.rank, ex.peer, ex.told_by, stage=stage)
    out.placed = True
    return out


@dataclass(frozen=True)
class RingLayout:
    """Byte layout of one rank's scheduler region (every rank uses the same one).

    Attributes:
        world: group size R.  slots: S, slots per peer and direction.  slot_bytes: bytes per slot (the
            chunk size; a multiple of 64).
    """
    world: int
    slots: int
    slot_bytes: int

    @property
    def ctrl_bytes(self) -> int:
        """Bytes of the control block (int64 words, rounded up to 4 KiB)."""
        return -(-F.ring_ctrl_words.host(self.world, self.slots) * 8 // 4096) * 4096

    @property
    def ring_bytes(self) -> int:
        """Bytes of one direction's ring (all peers)."""
        return self.world * self.slots * self.slot_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region: control block, send ring, receive ring."""
        return self.ctrl_bytes + 2 * self.ring_bytes

    def send_off(self, peer: int, seq: int) -> int:
        """Byte offset of the send slot of chunk ``seq`` for ``peer``."""
        return self.ctrl_bytes + (peer * self.slots + seq % self.slots) * self.slot_bytes

    def recv_off(self, src: int, seq: int) -> int:
        """Byte offset of the receive slot of chunk ``seq`` from ``src``."""
        return self.ctrl_bytes + self.ring_bytes + (src * self.slots + seq % self.slots) * self.slot_bytes

    def word_off(self, array: int, peer: int) -> int:
        """Byte offset of control word ``array[peer]`` (``flags.RING_*``)."""
        return 8 * F.ring_word.host(array, self.world, peer)


@dataclass(eq=False)        # (hashed by identity: the proxy keeps sets of them)
class _QPState:
    peer: int
    qp: int
    channel: int
    port: str
    inflight: Deque[Tuple[int, int, float]] = field(default_factory=collections.deque)  # (seq, bytes, t)
    owner: int = 0          # the proxy thread that posts on it
    out_bytes: int = 0
    total_bytes: int = 0
    wrs: int = 0
    chunks: int = 0
    unsignaled: int = 0
    parked: bool = False    # out of its port's heap: its window was full
    #: its port's heap of the picker (:meth:`Scheduler._push`) and its port's ``[outstanding, total]`` bytes
    heap: Optional[list] = None
    port_w: Optional[List[int]] = None


@dataclass
class _PeerState:
    next_post: int = 0
    sent: int = 0
    sent_set: set = field(default_factory=set)
    tail: int = 0
    arrived: set = field(default_factory=set)
    credit_sent: int = 0
    stall_since: Optional[float] = None
    #: ``CREDIT`` as of the last renumbering (:meth:`Scheduler.rebase`): a credit word the peer wrote before it
    #: and that lands after it never counts for less
    credit_floor: int = 0


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


class Scheduler:
    """One rank's RDMA scheduler: rings, proxy threads, credits, completions.

    Args:
        transport: a connected :class:`~triton_ep.transport.rdma.Transport` (QPs to every peer in RTS).
        slots: S, ring slots per peer and direction (bounded rings: a producer waits for a free slot).
        slot_bytes: bytes per slot = the chunk size (a multiple of 64).
        wr_bytes: bytes per RDMA WRITE (a chunk is cut into WRITEs of at most this, at least 64; default: one
            WRITE).
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
        self.qps_per_channel = qps_per_channel
        self.channels = nq // qps_per_channel
        self.proxies = max(1, min(proxies, self.channels))
        self.signal_every = max(1, signal_every)
        sq = int(getattr(transport, "sq_depth", 256))
        self.max_chunks_per_qp = max_chunks_per_qp or max(1, min(64, sq // 4))
        self.timeout_s = float(transport.timeout_s if timeout_s is None else timeout_s)
        self.on_signal, self.trace = on_signal, trace
        self.events: List[tuple] = []
        n = self.layout.nbytes
        if memory is not None and memory.nbytes < n:
            raise ValueError(f"memory holds fewer than the {n} bytes the rings need")
        self.region = transport.register(n if memory is None else memory)
        self.mem = self.region.view()[:n]
        self.mem[:] = 0
        self.flags = RingFlags(self.mem[:self.layout.ctrl_bytes].view(np.int64), self.rank, self.world, slots)
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
        self.arrival_words = bool(arrival_words)
        #: byte offsets of this rank's arrival words at a peer, per slot (where its chunks' arrival words go)
        self._arrive_off = [8 * F.ring_arrive_word.host(self.world, slots, self.rank, k) for k in range(slots)]
        # (with arrival words no WRITE_WITH_IMM arrives: no receive is consumed, none is posted)
        self._replenish = not getattr(transport, "auto_replenish", False) and not self.arrival_words
        self._init_statistics(cpu_split)
        #: per (proxy thread, peer, port): a heap of ``(out_bytes, total_bytes, qp)`` of its QPs with room
        #: in their window (stale entries are dropped when met), and the QPs with chunks in flight
        self._heaps: Dict[Tuple[int, int], Dict[str, list]] = {}
        self._picks: Dict[Tuple[int, int], List[Tuple[list, List[int]]]] = {}
        self._busy_qps: set = set()
        #: where the sweep finds each array in :meth:`RingFlags.snapshot` (``array[p]`` at its index + ``p``; ``LEN`` and
        #: ``ARRIVE``: + ``p * slots + slot``)
        R, f = self.world, self.flags
        self._w_head, self._w_credit, self._w_fault = ((a - RingFlags.READY) * R for a in
                                                       (RingFlags.HEAD, RingFlags.CREDIT, RingFlags.FAULT))
        self._w_len, self._w_masked, self._w_arrive = f.len0, f.masked0, f.arrive0
        #: word indices of ``TAIL[p]``, ``SENT[p]`` and ``SRC[p]`` (the sweep stores them into ``flags.w`` directly)
        self._i_tail, self._i_sent, self._i_src = ([f.index(a, p) for p in range(R)]
                                                   for a in (RingFlags.TAIL, RingFlags.SENT, RingFlags.SRC))
        #: a credit goes once the consumer freed this many slots since the last (or caught up)
        self._credit_every = max(1, slots // 2)
        #: the prepared keys of each slot's two work requests with arrival words (data, arrival word)
        self._arrival_keys = [((0, k), (1, k)) for k in range(slots)]
        #: when the sweep next checks the chunks in flight against ``timeout_s`` (monotonic seconds; every 1 ms)
        self._bound_at = 0.0
        #: when the sweep next probes the peers (:meth:`_probe`), and the peers with a probe in flight
        self._probe_at, self._probing = 0.0, set()
        #: peers one of whose work requests completed with ``IBV_WC_RETRY_EXC_ERR`` on a data QP, each with the
        #: :class:`ProxyError` that names that QP: a probe posted after it (``_confirming``) tells a QP that failed
        #: (the probe is acknowledged: that error is raised) from a peer that is gone (it fails too: PeerGoneError)
        self._suspect: Dict[int, ProxyError] = {}
        self._confirming: set = set()
        #: the stage of the host wait in progress (:meth:`wait_stage`), or None
        self.waiting: Optional[str] = None
        #: ``f(peer)``, called once where this scheduler fails because rank ``peer`` is gone (:class:`PeerGoneError`),
        #: from the thread that failed it: a mode's kernels that wait for that peer elsewhere than in the rings
        #: (low-latency across hosts) end their waits (their ``DEAD`` word). Must not raise.
        self.on_gone: Optional[Callable[[int], None]] = None

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

    # ---------------------------------------------------------------- set-up
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
        receive queues filled, and the QP picker's heaps."""
        for p in self.peers:
            for ent in self.t.placement(p):
                port = f"{ent.port.device}:{ent.port.port}" + (f"/lag{ent.port.lag_port}" if ent.port.lag_port else "")
                self._qps[(p, ent.qp)] = _QPState(p, ent.qp, ent.qp // self.qps_per_channel, port)
                if self._replenish:
                    self.t.post_recv(p, ent.qp, int(getattr(self.t, "rq_depth", 64)))
        for q in self._qps.values():
            q.owner = q.channel % self.proxies
            q.heap = self._heaps.setdefault((q.owner, q.peer), {}).setdefault(q.port, [])
            q.port_w = self._ports[q.port]
            self._push(q)
        #: per (proxy thread, peer): its ports' ``(heap, [outstanding, total])``, for the picker
        self._picks = {k: [(heap, self._ports[port]) for port, heap in ports.items()]
                       for k, ports in self._heaps.items()}

    def _prepare_wrs(self) -> None:
        """Build each chunk's work requests once per ring slot and QP (:meth:`Transport.prepare`), for chunks of one
        WRITE (``wr_bytes`` at least ``slot_bytes``): the WRITE_WITH_IMM of slot ``k`` (key ``k``), or with arrival
        words the data WRITE (key ``(0, k)``) and the arrival word's WRITE (key ``(1, k)``). A sweep then posts them
        with only length, immediate, ``wr_id`` and completion request new (:meth:`Transport.post_prepared`). Each peer's
        credit WRITE (8 bytes of ``SRC[p]`` into the peer's ``CREDIT[me]``, QP 0) is prepared too (key ``"credit"``)."""
        lay = self.layout
        for p in self.peers:        # the credit WRITE of each peer (:meth:`_credit`), whatever the chunks' shape
            self.t.prepare(p, 0, _CREDIT_KEY, Op(WRITE, self.region, lay.word_off(RingFlags.SRC, p), 8,
                                                 self._remote[p], lay.word_off(RingFlags.CREDIT, self.rank)))
            # the liveness probe (:meth:`_probe`): this rank's fault word (0 while healthy) into the peer's FAULT[me]
            self.t.prepare(p, 0, _PROBE_KEY, Op(WRITE, self.region, lay.word_off(RingFlags.SRC, self.rank), 8,
                                                self._remote[p], lay.word_off(RingFlags.FAULT, self.rank)))
        self._prepared = self.wr_bytes >= self.slot_bytes
        if not self._prepared:
            return
        for p in self.peers:
            rem = self._remote[p]
            for qp in range(self.t.num_qps_per_peer):
                for k in range(self.slots):
                    src, dst = lay.send_off(p, k), lay.recv_off(self.rank, k)
                    if not self.arrival_words:
                        self.t.prepare(p, qp, k, Op(WRITE_WITH_IMM, self.region, src, self.slot_bytes, rem, dst))
                        continue
                    self.t.prepare(p, qp, (0, k), Op(WRITE, self.region, src, self.slot_bytes, rem, dst))
                    self.t.prepare(p, qp, (1, k), Op(WRITE, self.region, 8 * self.flags.asrc_index(p, k), 8, rem,
                                                     self._arrive_off[k]))

    def close(self) -> None:
        """Let the proxy finish what was published (:meth:`drain`), then stop and join the proxy threads
        (idempotent).  The transport (QPs, MRs, CQs, PD) is the caller's: close it after this."""
        self.drain(min(self.timeout_s, DRAIN_S))
        self._stop.set()
        for th in self._threads:
            th.join(timeout=self.timeout_s + 5.0)
        self._threads = []

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

    def check(self) -> None:
        """Raise the proxy's error, if it failed (every host wait calls this). A :class:`PeerGoneError` is raised at
        the stage this rank waited at (:meth:`wait_stage`), the first time, and so on."""
        if self.error is not None:
            self.error = placed_error(self.error, self.wait_stage())
            raise self.error

    def wait_stage(self) -> Optional[str]:
        """Where this rank waited when the proxy failed: the stage of the ring kernel's wait that the failure ended
        (its record), else of the host wait in progress (:meth:`wait_counter`, :func:`host_alltoall`), else
        ``None``. (No peer in it: the scheduler's ranks are not the mode's.)"""
        rec = self.flags.record()
        if rec is not None:
            return f"{STAGE_NAMES.get(rec.stage, 'rdma ring')} (chunk {rec.call})"
        return getattr(self, "waiting", None)

    # ---------------------------------------------------------------- producer / consumer (host side)
    def send_view(self, peer: int, seq: int) -> np.ndarray:
        """uint8 view of the send slot of chunk ``seq`` for ``peer`` (``slot_bytes`` long)."""
        o = self.layout.send_off(peer, seq)
        return self.mem[o:o + self.slot_bytes]

    def recv_view(self, src: int, seq: int) -> np.ndarray:
        """uint8 view of the receive slot of chunk ``seq`` from ``src``."""
        o = self.layout.recv_off(src, seq)
        return self.mem[o:o + self.slot_bytes]

    def slot_free(self, peer: int, seq: int) -> bool:
        """Whether chunk ``seq`` for ``peer`` may be written (its slot's previous chunk was placed there)."""
        return self.flags.get(RingFlags.SENT, peer) > seq - self.slots

    def publish(self, peer: int, seq: int, nbytes: int) -> None:
        """Chunk ``seq`` (``nbytes``, 1..slot_bytes) for ``peer`` is written: set its length, then ``READY``."""
        self.flags.set_len(peer, seq, nbytes)
        self.flags.put(RingFlags.READY, peer, seq + 1)
        if self.trace:
            self._event("produce", peer, None, None, seq, nbytes)

    def reserve(self, tx: Mapping[int, int], rx: Mapping[int, int]) -> Tuple[Dict[int, int], Dict[int, int]]:
        """Number the next chunks: ``tx[p]`` to send to peer ``p`` and ``rx[p]`` to receive from it (a peer
        missing: none).  Producers (host or kernel) and consumers use these numbers; every rank must reserve
        matching amounts in the same order.  Returns ``(first_tx, first_rx)``: per peer, the first chunk's
        number."""
        first = (dict(self._next_tx), dict(self._next_rx))
        for p in self.peers:
            self._next_tx[p] += int(tx.get(p, 0))
            self._next_rx[p] += int(rx.get(p, 0))
        return first

    def resync(self) -> None:
        """Take the next chunk numbers from the ring counters (``READY`` to send, ``HEAD`` to receive): after
        kernels numbered their chunks themselves from those counters, once every chunk they produced and
        consumed is done (the caller waited for the device)."""
        for p in self.peers:
            self._next_tx[p] = self.flags.get(RingFlags.READY, p)
            self._next_rx[p] = self.flags.get(RingFlags.HEAD, p)

    def wait_quiet(self, peer: int, stage: str) -> None:
        """Wait until no chunk to ``peer`` is in flight (every chunk posted to it completed), bounded by
        ``timeout_s``: before :meth:`rebase`. A masked peer's failed completions retire nothing, so a peer whose
        QPs failed never gets quiet.

        Raises: the proxy's error; ``EPTimeoutError(rank, peer, stage)`` after the bound (the scheduler is then
        failed, as after any host wait that runs out).
        """
        def busy() -> bool:
            with self._lock:
                return any(q.inflight for (p, _), q in self._qps.items() if p == peer)
        self._wait_while(busy, peer, stage)

    def rebase(self, peer: int, tx: int, rx: int) -> None:
        """Renumber the rings with ``peer`` and unmask it (its ``MASKED`` word): the next chunk this rank sends
        it is ``tx``, the next it receives from it ``rx`` (``READY`` = ``SENT`` = ``CREDIT`` = ``tx``, ``TAIL`` =
        ``HEAD`` = ``rx``: nothing pending either way, chunks not consumed are dropped; with arrival words ``rx`` must
        be past every chunk from ``peer`` that arrived, else ``ValueError``). Both ranks of the pair
        call it with matching numbers (this rank's ``tx`` is the peer's ``rx``), with no chunk in flight to
        ``peer`` (:meth:`wait_quiet`) and no producer or consumer of its rings running (the device work
        finished). Unmasking a rank on another host (``Buffer.low_latency_update_mask_buffer(rank, False)``,
        ``low_latency_clean_mask_buffer``) uses it: a masked peer's chunks were dropped (counted as placed), so
        the two sides' counters no longer match. A signal of a chunk numbered before this that completes after
        it is recognised (behind the tail) and ignored."""
        tx, rx = int(tx), int(rx)
        if self.arrival_words:
            # the arrival words from peer hold chunk numbers + 1 of chunks placed before: the new numbering must
            # start past them, else a stale word would read as the arrival of a new chunk
            words = self.flags.arrivals()[peer * self.slots:(peer + 1) * self.slots]
            if max(words) > rx:
                raise ValueError(f"rank {self.rank}: rebase of the rings with peer {peer} to receive chunk {rx} next, "
                                 f"but chunks up to {max(words) - 1} from it already arrived (arrival words {words})")
        with self._lock:
            st = self._peer[peer]
            st.next_post = st.sent = tx
            st.sent_set.clear()
            st.credit_floor = tx
            st.tail = rx
            st.arrived.clear()
            st.credit_sent = rx
            st.stall_since = None
            for word, v in ((RingFlags.READY, tx), (RingFlags.SENT, tx), (RingFlags.CREDIT, tx),
                            (RingFlags.TAIL, rx), (RingFlags.HEAD, rx)):
                self.flags.put(word, peer, v)
            self._next_tx[peer], self._next_rx[peer] = tx, rx
            self.flags.mask(peer, False)

    def arrived(self, src: int) -> int:
        """``TAIL[src]``: chunks from ``src`` that arrived, in order."""
        return self.flags.get(RingFlags.TAIL, src)

    def consume(self, src: int, upto: int) -> None:
        """Chunks from ``src`` below ``upto`` are consumed: release ``HEAD[src]`` (their slots are free)."""
        self.flags.put(RingFlags.HEAD, src, upto)

    def wait_counter(self, array: int, peer: int, want: int, stage: str) -> None:
        """Wait until control word ``array[peer] >= want`` (host side), bounded by ``timeout_s``.

        Raises: the proxy's error; ``EPTimeoutError(rank, peer, stage)`` after the bound.
        """
        self._wait_while(lambda: self.flags.get(array, peer) < want, peer, stage)

    def _wait_while(self, pending: Callable[[], bool], peer: int, stage: str) -> None:
        """The host waits' loop: while ``pending()``, raise the proxy's error if it has one, else spin (then nap),
        up to ``timeout_s``; past it, fail the scheduler with ``EPTimeoutError(rank, peer, stage)`` and raise it."""
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        self.waiting = stage
        try:
            while pending():
                self.check()
                if time.monotonic() > deadline:
                    ex = EPTimeoutError(self.rank, peer, stage, self.timeout_s)
                    self.fail(ex)
                    raise ex
                spins += 1
                time.sleep(0 if spins < 50 else 0.0002)
        finally:
            self.waiting = None

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

    def _run(self, own: List[_QPState]) -> None:
        idle = 0
        try:
            wall, cpu = time.perf_counter_ns, time.thread_time_ns
            stop = self._stop
            # The thread's CPU clock (a system call, about 1 µs) is read once per pass: after a busy sweep (whose CPU
            # time runs from the previous read) and after an idle sweep's wait (where the next sweep's time starts).
            c0 = cpu()
            while not stop.is_set():
                t0 = wall()
                with self._lock:        # (the counters too: proxy threads share them, stats() reads them whole)
                    self._sweep_tx_ns = self._sweep_tx_cpu_ns = 0
                    did = self._sweep(own)
                    if did:
                        c1 = cpu()
                        self._busy_ns += wall() - t0
                        self.busy_sweeps += 1
                        self._busy_cpu_ns += c1 - c0
                        self._transport_ns += self._sweep_tx_ns
                        self._transport_cpu_ns += self._sweep_tx_cpu_ns
                if did:
                    idle, c0 = 0, c1
                else:
                    idle += 1
                    self._idle_wait(idle)
                    c0 = cpu()
        except BaseException as ex:   # noqa: BLE001  (recorded, raised by check() in the caller's thread)
            self.fail(ex)

    def _idle_wait(self, idle: int) -> None:
        """The proxy thread's pause after ``idle`` sweeps in a row that moved nothing: a yield for the first 20, then
        50 µs (a proxy thread waits for the GIL anyway while the rank's Python runs). The proxy process's scheduler
        backs off further (:class:`triton_ep.proxy_process.ProxySweeps`)."""
        time.sleep(0 if idle < 20 else 0.00005)

    def fail(self, ex: BaseException) -> None:
        """Record ``ex`` as this scheduler's error (the first one wins), end every ring wait (the abort
        word), stop the proxy threads and tell every peer through its ``FAULT`` word, so they raise
        :class:`ProxyRemoteError` instead of waiting out their bound.  Host waits that time out call this;
        so does a failing proxy thread."""
        stage = getattr(ex, "stage", STAGE_NAMES[STAGE_INTERNAL])
        code = next((k for k, v in STAGE_NAMES.items() if stage.startswith(v)), STAGE_INTERNAL)
        if not isinstance(ex, EPError):
            ex = ProxyError(self.rank, getattr(ex, "peer", None), None, None, STAGE_NAMES[STAGE_INTERNAL],
                            f"{type(ex).__name__}: {ex}")
        with self._lock:
            first = self.error is None
            if first:
                self.error = ex
        self.flags.abort(2)
        self._stop.set()
        if first and isinstance(ex, PeerGoneError) and self.on_gone is not None:
            self.on_gone(ex.peer)
        if not first or isinstance(ex, ProxyRemoteError) or getattr(ex, "told_by", None) is not None:
            return      # (the peer that failed, or found a rank gone, told its peers itself)
        gone = ex.peer if isinstance(ex, PeerGoneError) else None
        self.flags.put(RingFlags.SRC, self.rank,
                       fault_word(code, getattr(ex, "channel", None), getattr(ex, "qp", None), gone))
        lay = self.layout
        with self._lock:
            for p in self.peers:                # every QP: the one that failed may be any of them
                for q in range(self.t.num_qps_per_peer):
                    try:
                        self.t.post(p, q, [Op(WRITE, self.region, lay.word_off(RingFlags.SRC, self.rank), 8,
                                              self._remote[p], lay.word_off(RingFlags.FAULT, self.rank))])
                    except Exception:   # noqa: BLE001  (best effort: a broken QP cannot carry it)
                        pass

    def _sweep(self, own: List[_QPState]) -> bool:
        """One pass of a proxy thread: completions, the ring words, faults, posts, credits, probes, bounds.  Returns
        whether anything moved.  Raises ProxyError."""
        did = False
        wall, split = time.perf_counter_ns, self._cpu_split
        t0, c0 = wall(), (time.thread_time_ns() if split else 0)       # (_tx_begin / _tx_done, inline)
        try:
            comps = self.t.poll(raise_on_error=False)
        except Exception as ex:   # noqa: BLE001
            raise ProxyError(self.rank, None, None, None, STAGE_NAMES[STAGE_SEND_CQE], f"poll failed: {ex}") from ex
        finally:
            if split:
                self._sweep_tx_cpu_ns += time.thread_time_ns() - c0
            self._sweep_tx_ns += wall() - t0
        if comps:
            did = True
            on = self._on_completion
            for c in comps:
                on(c)
        words = self.flags.snapshot()       # READY .. SRC, LEN, MASKED, ARRIVE of every peer: one read
        if self.arrival_words:
            did |= self._arrivals(words)
        f0 = self._w_fault
        if any(words[f0:f0 + self.world]):        # (the rare case)
            self._raise_fault(words)
        now = time.monotonic()
        # per QP: Ops to post (a test hook replaced _chunk_ops), or prepared work requests (key, length, imm,
        # wr_id, signaled): one post call per QP and sweep either way
        batches: Optional[Dict[Tuple[int, int], list]] = None
        prepared = False
        for p, st in self._peer_list:
            if words[p] > st.next_post:         # (else nothing ready: no call)
                if batches is None:
                    batches = {}
                    prepared = self._prepared and getattr(self._chunk_ops, "__func__", None) is _CHUNK_OPS
                did |= self._gather(p, own, batches, now, words, prepared)
            else:
                st.stall_since = None
        if batches:
            self._post_batches(batches, prepared)
        h0, m0 = self._w_head, self._w_masked
        for p, st in self._peer_list:
            if words[h0 + p] > st.credit_sent:    # (the common case, nothing freed, without a call)
                did |= self._credit(p, words[h0 + p])
            elif st.tail > st.credit_sent and words[m0 + p]:
                did |= self._credit(p, st.tail)   # nothing consumes a masked peer's chunks: slots go back on arrival
        if now >= self._probe_at:
            self._probe(now)
        if now >= self._bound_at and self._busy_qps:     # (every 1 ms: the bound is seconds)
            self._bound_at = now + 0.001
            for q in self._busy_qps:           # (the QPs with chunks in flight, not all of them)
                if q.inflight and now - q.inflight[0][2] > self.timeout_s and not self.flags.masked(q.peer):
                    raise ProxyError(self.rank, q.peer, q.channel, q.qp, STAGE_NAMES[STAGE_SEND_WAIT],
                                     f"chunk {q.inflight[0][0]} not completed within {self.timeout_s:g} s")
        return did

    def _raise_fault(self, words: list) -> None:
        """A peer's ``FAULT`` word is set (``words``: :meth:`RingFlags.snapshot`): unless that peer is masked, raise
        :class:`PeerGoneError` where it names a gone rank (not masked here), else :class:`ProxyRemoteError`."""
        f0, m0 = self._w_fault, self._w_masked
        for p in self.peers:
            w = words[f0 + p]
            if w and not words[m0 + p]:
                st, ch, q = parse_fault(w)
                gone = fault_gone(w)
                if gone is not None and gone != self.rank and not (gone in self._peer and words[m0 + gone]):
                    raise PeerGoneError(self.rank, gone, None, None, STAGE_NAMES.get(st, "rdma proxy"),
                                        "its QPs stopped acknowledging a peer's RDMA proxy", told_by=p)
                raise ProxyRemoteError(self.rank, p, ch, q, STAGE_NAMES.get(st, "rdma proxy"),
                                       "the peer's proxy failed there and told its peers")

    def _post_batches(self, batches: Dict[Tuple[int, int], list], prepared: bool) -> None:
        """One post call per QP of this sweep's chains (:meth:`_gather`): prepared work requests, or ``Op``s."""
        wall, split = time.perf_counter_ns, self._cpu_split
        for (p, qp), ops in batches.items():
            t0, c0 = wall(), (time.thread_time_ns() if split else 0)
            try:
                if prepared:
                    self.t.post_prepared(p, qp, ops)
                else:
                    self.t.post(p, qp, ops)
            except Exception as ex:   # noqa: BLE001
                raise ProxyError(self.rank, p, qp // self.qps_per_channel, qp, STAGE_NAMES[STAGE_POST],
                                 f"{type(ex).__name__}: {ex}") from ex
            finally:
                if split:
                    self._sweep_tx_cpu_ns += time.thread_time_ns() - c0
                dt = wall() - t0
                self._sweep_tx_ns += dt
                self._post_ns += dt
            self.wrs_posted += len(ops)

    def _probe(self, now: float) -> None:
        """Post a liveness probe (prepared at start: 8 bytes, signalled, ``wr_id`` :data:`TAG_PROBE` | peer) on QP 0
        of each peer that is not masked and has none in flight; the next round in :data:`PROBE_S`. Its completion
        clears it; an error completion fails the proxy (:meth:`_on_completion`: ``PeerGoneError`` where the peer
        never acknowledged it). Raises ProxyError where the post itself fails."""
        self._probe_at = now + PROBE_S
        for p in self.peers:
            if p in self._probing or self.flags.masked(p):
                continue
            t0, c0 = self._tx_begin()
            try:
                self.t.post_prepared(p, 0, ((_PROBE_KEY, 8, 0, TAG_PROBE | p, True),))
            except Exception as ex:   # noqa: BLE001
                raise ProxyError(self.rank, p, 0, 0, STAGE_NAMES[STAGE_POST],
                                 f"liveness probe: {type(ex).__name__}: {ex}") from ex
            finally:
                self._tx_done(t0, c0)
            self._probing.add(p)
            if p in self._suspect:
                self._confirming.add(p)
            self.probes_posted += 1

    def _arrivals(self, words: list) -> bool:
        """With arrival words: move each peer's ``TAIL`` past the chunks whose arrival words have landed (in order; a
        slot's word is ``k + 1`` once chunk ``k`` is placed there; ``words``: :meth:`RingFlags.snapshot`). Returns
        whether a tail moved."""
        S, moved, a0 = self.slots, False, self._w_arrive
        for p, st in self._peer_list:
            tail = st.tail
            while words[a0 + p * S + tail % S] > tail:
                if self.on_signal is not None:
                    self.on_signal(p, None, tail)
                if self.trace:
                    self._event("arrive", p, None, None, tail, 0)
                tail += 1
            if tail != st.tail:
                st.tail = tail
                self.flags.put(RingFlags.TAIL, p, tail)
                moved = True
        return moved

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
        return dt

    def _choose(self, own: List[_QPState], peer: int) -> Optional[_QPState]:
        """The QP for the next chunk to ``peer``: the port with the fewest bytes posted so far (so the ports'
        totals never differ by more than one chunk), then least outstanding bytes on the port and on the QP,
        then least bytes so far (equal loads deal round-robin); ``None`` when every QP has a full window (a
        congested port's QPs fill their windows and are passed over, so the other port takes the chunks)."""
        return self._pick(self._picks.get((own[0].owner if own else -1, peer), ()))

    def _pick(self, ports: List[Tuple[list, List[int]]]) -> Optional[_QPState]:
        """:meth:`_choose` over ``ports``, one proxy thread's ``(heap, [outstanding, total])`` per port for one peer.
        Each port's best QP heads its heap as ``(out_bytes, total_bytes, qp index, QP)``: an entry is stale once
        its QP's bytes moved (dropped when met); a QP whose window is full leaves its heap until a completion
        frees room. The port key decides between the heads."""
        best, key = None, None
        window = self.max_chunks_per_qp
        for heap, pw in ports:
            while heap:             # the head, stale and full entries dropped
                out, total, _, q = heap[0]
                if out == q.out_bytes and total == q.total_bytes:
                    if len(q.inflight) < window:
                        break
                    q.parked = True         # full: pushed again when a completion frees its window
                heapq.heappop(heap)
            else:
                continue
            k = (pw[1], pw[0], out, total, q.qp)
            if key is None or k < key:
                best, key = q, k
        return best

    def _push(self, q: _QPState) -> None:
        """``q``'s bytes changed (or its window has room again): a fresh entry in its port's heap."""
        heap = q.heap
        if len(heap) > 4 * self.t.num_qps_per_peer + 64:     # many stale entries: rebuild from the live QPs
            live = {e[3] for e in heap}
            heap[:] = [(x.out_bytes, x.total_bytes, x.qp, x) for x in live if x is not q and not x.parked]
            heapq.heapify(heap)
        q.parked = False
        heapq.heappush(heap, (q.out_bytes, q.total_bytes, q.qp, q))

    def _gather(self, p: int, own: List[_QPState], batches: Dict[Tuple[int, int], list], now: float,
                words: list, prepared: bool = False) -> bool:
        """Move ready (below ``READY[p]``), credited chunks for peer ``p`` into per-QP chains in ``batches``
        (accounted as posted): ``Op``s, or with ``prepared`` the prepared work requests' ``(key, length, imm, wr_id,
        signaled)`` (:meth:`_prepare_wrs`). ``words``: the sweep's :meth:`RingFlags.snapshot`."""
        st = self._peer[p]
        ready = words[p]
        if words[self._w_masked + p]:        # a masked peer's chunks are dropped, counted as placed
            st.next_post = st.sent = ready
            st.stall_since = None
            self.flags.put(RingFlags.SENT, p, ready)
            return True
        credit = words[self._w_credit + p]
        if credit < st.credit_floor:
            credit = st.credit_floor
        picks = self._picks.get((own[0].owner if own else -1, p), ())
        end = min(ready, credit + self.slots)
        if prepared:
            moved = self._place_prepared(p, st, picks, end, now, batches, words)
        else:
            chains = self._place(p, st, picks, end, now, words)
            self._chain_ops(p, chains, batches)
            moved = bool(chains)
        if st.next_post < ready and st.next_post - credit >= self.slots:
            self._stalled(p, st, credit, now)
        else:
            st.stall_since = None
        return moved

    def _chunk_len(self, p: int, q: _QPState, seq: int, words: list) -> int:
        """Bytes of chunk ``seq`` for ``p`` (its ``LEN`` word in ``words``). Raises :class:`ProxyError` outside
        ``1..slot_bytes``."""
        n = words[self._w_len + p * self.slots + seq % self.slots]
        if not 0 < n <= self.slot_bytes:
            raise ProxyError(self.rank, p, q.channel, q.qp, STAGE_NAMES[STAGE_POST],
                             f"chunk {seq} has length {n} (expected 1..{self.slot_bytes})")
        return n

    def _place_prepared(self, p: int, st: _PeerState, picks, end: int, now: float,
                        batches: Dict[Tuple[int, int], list], words: list) -> bool:
        """Peer ``p``'s chunks from ``st.next_post`` up to ``end`` (ready and credited), each on the QP the picker
        chooses among ``picks`` (until none has room), accounted as posted, appended to that QP's chain in
        ``batches`` as prepared work requests (what :meth:`_chunk_ops` + :func:`_fold_signal` would build): every
        ``signal_every``-th chunk of a QP and the last of each chain signalled. Returns whether any chunk went."""
        S, every, arrival, trace = self.slots, self.signal_every, self.arrival_words, self.trace
        l0, C = self._w_len + p * S, self.slot_bytes
        chains = []         # (QP, its chain) of this peer in this sweep
        seq = st.next_post
        while seq < end:
            q = self._pick(picks)
            if q is None:
                break
            k = seq % S
            n = words[l0 + k]
            if not 0 < n <= C:
                self._chunk_len(p, q, seq, words)       # (raises)
            self._account(q, seq, n, now)
            batch = batches.get((p, q.qp))
            if batch is None:
                batch = batches[(p, q.qp)] = []
                chains.append((q, batch))
            q.unsignaled += 1
            sig = q.unsignaled >= every
            if sig:
                q.unsignaled = 0
            wr_id = TAG_CHUNK | (seq & _SEQ_MASK)
            if arrival:     # the data, then the arrival word seq + 1 from its ASRC word (_signal_op)
                self.flags.w[self.flags.asrc_index(p, seq)] = seq + 1
                data_key, word_key = self._arrival_keys[k]
                batch.append((data_key, n, 0, None, False))
                batch.append((word_key, 8, 0, wr_id, sig))
                q.wrs += 2
            else:           # one WRITE_WITH_IMM carrying the signal
                batch.append((k, n, seq & 0xFFFFFFFF, wr_id, sig))
                q.wrs += 1
            if trace:
                self._event("post", p, q.channel, q.qp, seq, n)
            seq += 1
        st.next_post = seq
        for q, batch in chains:     # each chain's last chunk is signalled
            last = batch[-1]
            if not last[4]:
                batch[-1] = last[:4] + (True,)
                q.unsignaled = 0
        return bool(chains)

    def _place(self, p: int, st: _PeerState, picks, end: int, now: float,
               words: list) -> Dict[_QPState, List[Tuple[int, int]]]:
        """:meth:`_place_prepared` for ``Op``s: returns per QP its ``(seq, length)`` in order, for :meth:`_chain_ops`.
        Raises :class:`ProxyError` on a chunk length outside ``1..slot_bytes``."""
        chains: Dict[_QPState, List[Tuple[int, int]]] = {}
        while st.next_post < end:
            q = self._pick(picks)
            if q is None:
                break
            seq = st.next_post
            n = self._chunk_len(p, q, seq, words)
            chains.setdefault(q, []).append((seq, n))
            self._account(q, seq, n, now)
            st.next_post = seq + 1
        return chains

    def _stalled(self, p: int, st: _PeerState, credit: int, now: float) -> None:
        """Peer ``p`` has ready chunks beyond the ``credit`` it consumed plus the ring's slots: start the clock of that
        wait, or raise :class:`ProxyError` once it is over ``timeout_s``."""
        st.stall_since = st.stall_since or now
        if now - st.stall_since > self.timeout_s:
            raise ProxyError(self.rank, p, None, None, STAGE_NAMES[STAGE_CREDIT],
                             f"chunk {st.next_post} has had no room at the peer for {self.timeout_s:g} s "
                             f"(it consumed {credit} chunks)")

    def _chain_ops(self, p: int, chains: Dict[_QPState, List[Tuple[int, int]]],
                   batches: Dict[Tuple[int, int], list]) -> None:
        """Append the ``Op``s of ``chains`` (:meth:`_place`) to ``batches`` per ``(peer, QP)``, every
        ``signal_every``-th and each chain's last signalled (a test hook replaced :meth:`_chunk_ops`, or chunks of
        several WRITEs)."""
        # chunks of one WRITE skip _chunk_ops + _fold_signal, unless a test hook replaced _chunk_ops
        fast = (self.wr_bytes >= self.slot_bytes and not self.arrival_words
                and getattr(self._chunk_ops, "__func__", None) is _CHUNK_OPS)
        every = self.signal_every
        for q, seqs in chains.items():
            qp = q.qp
            last = len(seqs) - 1
            for i, (seq, n) in enumerate(seqs):
                q.unsignaled += 1
                sig = q.unsignaled >= every or i == last
                if sig:
                    q.unsignaled = 0
                if fast:        # one WRITE carrying the signal: what _fold_signal makes of _chunk_ops' two
                    batches.setdefault((p, qp), []).append(self._signal_op(p, seq, n, sig))
                    q.wrs += 1
                    if self.trace:
                        self._event("post", p, q.channel, qp, seq, n)
                    continue
                for tqp, op in _fold_signal(self._chunk_ops(p, qp, seq, n, sig)):
                    batches.setdefault((p, tqp), []).append(op)
                    q.wrs += 1
                    if tqp != qp and is_chunk_signal(op):   # the signal went elsewhere: retire it there
                        ent = next(e for e in q.inflight if e[0] == seq)
                        q.inflight.remove(ent)
                        if q.parked:            # its window has room again
                            self._push(q)
                        other = self._qps[(p, tqp)].inflight
                        other.append(ent)
                        other = sorted(other)
                        self._qps[(p, tqp)].inflight = collections.deque(other)
                        self._busy_qps.add(self._qps[(p, tqp)])
                if self.trace:
                    self._event("post", p, q.channel, qp, seq, n)

    def _account(self, q: _QPState, seq: int, n: int, now: float) -> None:
        """Chunk ``seq`` of ``n`` bytes goes on ``q``: its bytes count as posted there and on its port."""
        q.out_bytes += n
        q.total_bytes += n
        q.chunks += 1
        port = q.port_w
        port[0] += n
        port[1] += n
        if not q.inflight:
            self._busy_qps.add(q)
        q.inflight.append((seq, n, now))   # moved to the signal's QP where that is another one
        self._push(q)

    def _chunk_ops(self, peer: int, qp: int, seq: int, nbytes: int, signaled: bool) -> List[Tuple[int, Op]]:
        """The work requests of one chunk, as ``(QP index, Op)``: its WRITEs, then its signal (a zero-length
        WRITE_WITH_IMM with the chunk number as immediate), all on QP ``qp``; the caller folds the signal into the
        last WRITE where both are on one QP (:func:`_fold_signal`).

        A documented test hook: the ordering tests subclass the scheduler and override this method to post the
        signal on another QP (the planted bug in-QP ordering exists to prevent), and check that their
        property fails; every QP index returned must be below ``num_qps_per_peer``. While it is not replaced (on
        the instance, the class or in a subclass: ``testing.drop_rdma_signal``, the ordering and fault tests), a
        chunk of one WRITE (``wr_bytes`` at least ``slot_bytes``, the default) is built directly as the folded
        WRITE_WITH_IMM, without calling it (the same work request, a few µs less of the proxy's Python)."""
        lay, rem = self.layout, self._remote[peer]
        src, dst = lay.send_off(peer, seq), lay.recv_off(self.rank, seq)
        ops = [(qp, Op(WRITE, self.region, src + o, min(self.wr_bytes, nbytes - o), rem, dst + o))
               for o in range(0, nbytes, self.wr_bytes)]
        ops.append((qp, self._signal_op(peer, seq, 0, signaled)))
        return ops

    def _signal_op(self, peer: int, seq: int, nbytes: int, signaled: bool) -> Op:
        """Chunk ``seq``'s signal to ``peer``: a WRITE_WITH_IMM of the first ``nbytes`` of its slot (0: the
        zero-length signal of :meth:`_chunk_ops`; the chunk's length: the whole chunk as one work request), the
        chunk number as immediate and in ``wr_id``. With arrival words (``nbytes`` 0): the WRITE of the arrival word
        ``seq + 1`` from its ``ASRC`` word into the peer's ``ARRIVE`` word of the slot (``wr_id`` as above)."""
        lay = self.layout
        if self.arrival_words and not nbytes:
            # The NIC reads the source word when it executes the WRITE, after this returns. It is rewritten only
            # for chunk seq + slots, which goes once the peer's credit passed seq: the peer consumed chunk seq, so
            # it saw this word land, so the NIC had read it.
            i = self.flags.asrc_index(peer, seq)
            self.flags.w[i] = seq + 1
            return Op(WRITE, self.region, 8 * i, 8, self._remote[peer], self._arrive_off[seq % self.slots],
                      signaled=signaled, wr_id=TAG_CHUNK | (seq & _SEQ_MASK))
        return Op(WRITE_WITH_IMM, self.region, lay.send_off(peer, seq), nbytes, self._remote[peer],
                  lay.recv_off(self.rank, seq), imm=seq & 0xFFFFFFFF, signaled=signaled,
                  wr_id=TAG_CHUNK | (seq & _SEQ_MASK))

    def _on_completion(self, c: Completion) -> None:
        peer = c.peer
        if peer is None:            # not one of our QPs' (cannot happen with one transport per scheduler)
            return
        probe = (c.opcode != "recv_imm" and c.wr_id is not None and bool(c.wr_id & TAG_PROBE)
                 and not c.wr_id & TAG_CHUNK)
        if probe:
            self._probing.discard(peer)
            if peer in self._suspect:
                self._probe_at = 0.0            # (confirm at the next sweep)
                if c.status == "IBV_WC_SUCCESS" and peer in self._confirming:
                    raise self._suspect[peer]   # the peer acknowledged QP 0 after its other QP failed: that QP
        if c.status != "IBV_WC_SUCCESS":
            if self.flags.masked(peer):        # a masked (dead) peer's QPs may fail: nothing waits for them
                return
            stage = STAGE_RECV_CQE if c.opcode == "recv_imm" else STAGE_SEND_CQE
            ch = None if c.qp is None else c.qp // self.qps_per_channel
            what = f"work completion {c.status} ({c.opcode}, wr_id {c.wr_id:#x}, QP number {c.qp_num})"
            if c.status == STATUS_GONE and (probe or c.qp == 0):
                raise PeerGoneError(self.rank, peer, ch, c.qp, STAGE_NAMES[stage],
                                    f"its QP {c.qp} stopped acknowledging: {what}, after the QP's retries")
            if c.status == STATUS_GONE:         # a data QP: that QP failed, or the whole peer? a probe tells
                if peer not in self._suspect:
                    self._suspect[peer] = ProxyError(self.rank, peer, ch, c.qp, STAGE_NAMES[stage], what)
                    self._probe_at = 0.0
                return
            raise ProxyError(self.rank, peer, ch, c.qp, STAGE_NAMES[stage], what)
        if c.opcode == "recv_imm":
            st = self._peer[peer]
            tail = st.tail
            ahead = (c.imm - tail) & 0xFFFFFFFF
            if ahead < 1 << 31:         # (else a chunk numbered before a renumbering, already counted: rebase)
                seq = tail + ahead
                if self.on_signal is not None:
                    self.on_signal(peer, c.qp, seq)
                if self.trace:
                    self._event("arrive", peer, c.qp // self.qps_per_channel, c.qp, seq, 0)
                arrived = st.arrived
                if seq == tail:         # (the common case: in order)
                    tail += 1
                    while arrived and tail in arrived:
                        arrived.discard(tail)
                        tail += 1
                    st.tail = tail
                else:
                    arrived.add(seq)
                self.flags.w[self._i_tail[peer]] = tail
            if self._replenish:
                t0, c0 = self._tx_begin()
                self.t.post_recv(peer, c.qp, 1)
                self._tx_done(t0, c0)
        elif c.wr_id & TAG_CHUNK:
            self._retire(self._qps[(peer, c.qp)], c.wr_id & _SEQ_MASK)

    def _retire(self, q: _QPState, seq: int) -> None:
        """A signalled chunk ``seq`` of ``q`` completed: it and every earlier chunk of ``q`` are placed."""
        st = self._peer[q.peer]
        inflight = q.inflight
        if not inflight or inflight[0][0] > seq:
            return
        port = q.port_w
        sent, done = st.sent, st.sent_set
        while inflight and inflight[0][0] <= seq:
            s, n, _ = inflight.popleft()
            q.out_bytes -= n
            port[0] -= n
            if s == sent:           # (in order: no set)
                sent += 1
            elif s > sent:          # (below: a chunk numbered before a renumbering, rebase)
                done.add(s)
        while done and sent in done:
            done.discard(sent)
            sent += 1
        st.sent = sent
        self._push(q)
        if not inflight:
            self._busy_qps.discard(q)
        self.flags.w[self._i_sent[q.peer]] = sent

    def _credit(self, p: int, head: int) -> bool:
        """Send ``head`` (``HEAD[p]`` as the sweep read it; for a masked peer, whose chunks nothing consumes, the
        chunks that arrived) to ``p``'s ``CREDIT[me]`` when half a ring was freed or the consumer caught up. A
        peer that masked this rank (and was not masked here) so never stalls for credit: its chunks land and
        are discarded until its own kernels mask this rank."""
        st = self._peer[p]
        if head <= st.credit_sent or (head - st.credit_sent < self._credit_every and head < st.tail):
            return False
        self.flags.w[self._i_src[p]] = head
        t0, c0 = self._tx_begin()
        try:        # (the WRITE of SRC[p] into the peer's CREDIT[me], prepared at start)
            self.t.post_prepared(p, 0, _CREDIT_REQ)
        except Exception as ex:   # noqa: BLE001
            raise ProxyError(self.rank, p, 0, 0, STAGE_NAMES[STAGE_POST], f"credit write: {type(ex).__name__}: {ex}") from ex
        finally:
            self._tx_done(t0, c0)
        self.wrs_posted += 1
        st.credit_sent = head
        return True


#: the scheduler's own ``_chunk_ops`` (a chunk skips it only while nothing replaced it: the ordering tests do)
_CHUNK_OPS = Scheduler._chunk_ops
#: the prepared credit WRITE's key (QP 0 of each peer) and its post: 8 bytes, unsignalled
_CREDIT_KEY = "credit"
_CREDIT_REQ = ((_CREDIT_KEY, 8, 0, None, False),)
#: the prepared liveness probe's key (QP 0 of each peer)
_PROBE_KEY = "probe"


def _fold_signal(ops: List[Tuple[int, Op]]) -> List[Tuple[int, Op]]:
    """A chunk's work requests with its signal folded into its last WRITE where both go on the same QP: that
    WRITE becomes the WRITE_WITH_IMM (same bytes, the signal's immediate, completion request and ``wr_id``), one
    work request fewer. In-QP ordering is unchanged: the immediate's receive completion still says that every
    byte before it on the QP, its own included, is placed (the verbs spec's WRITE_WITH_IMM carries data). A
    signal on another QP than the data (the ordering tests' planted bug), or a chunk without one, is left as
    it is."""
    if len(ops) < 2:
        return ops
    (qs, sig), (qw, last) = ops[-1], ops[-2]
    if sig.kind != WRITE_WITH_IMM or sig.length or last.kind != WRITE or qs != qw:
        return ops
    folded = Op(WRITE_WITH_IMM, last.region, last.offset, last.length, last.remote, last.remote_offset,
                imm=sig.imm, signaled=sig.signaled, wr_id=sig.wr_id)
    return ops[:-2] + [(qw, folded)]


@dataclass
class _HostAlltoall:
    """One :func:`host_alltoall` in progress: per peer, its chunks (``slot_bytes`` each) and how far they went."""
    sched: Scheduler
    sends: Mapping[int, np.ndarray]     # peer -> uint8 bytes to send
    out: Dict[int, np.ndarray]          # peer -> uint8 bytes received (filled chunk by chunk)
    ntx: Dict[int, int]                 # peer -> chunks to send
    nrx: Dict[int, int]                 # peer -> chunks to receive
    tx0: Dict[int, int]                 # peer -> number of the first chunk sent (Scheduler.reserve)
    rx0: Dict[int, int]                 # peer -> number of the first chunk received
    done_tx: Dict[int, int] = field(default_factory=dict)     # peer -> chunks written into the send ring
    done_rx: Dict[int, int] = field(default_factory=dict)     # peer -> chunks read out of the receive ring

    def pending(self, p: int) -> bool:
        """Whether peer ``p`` has chunks to write or read, or written chunks not yet placed at the peer."""
        return (self.done_tx[p] < self.ntx[p] or self.done_rx[p] < self.nrx[p]
                or self.sched.flags.get(RingFlags.SENT, p) < self.tx0[p] + self.ntx[p])

    def move(self, p: int) -> bool:
        """Write what fits of peer ``p``'s chunks into free send slots and read what arrived from it; whether
        anything moved."""
        sched, C, moved = self.sched, self.sched.slot_bytes, False
        tx0, rx0, done_tx, done_rx = self.tx0[p], self.rx0[p], self.done_tx, self.done_rx
        while done_tx[p] < self.ntx[p] and sched.slot_free(p, tx0 + done_tx[p]):
            k = done_tx[p]
            piece = self.sends[p][k * C:(k + 1) * C]
            sched.send_view(p, tx0 + k)[:len(piece)] = piece
            sched.publish(p, tx0 + k, len(piece))
            done_tx[p] += 1
            moved = True
        tail = sched.arrived(p) - rx0
        out = self.out[p]
        while done_rx[p] < min(self.nrx[p], tail):
            k = done_rx[p]
            n = min(C, len(out) - k * C)
            out[k * C:k * C + n] = sched.recv_view(p, rx0 + k)[:n]
            done_rx[p] += 1
            sched.consume(p, rx0 + done_rx[p])
            moved = True
        return moved

    def check_stall(self, idle_s: float) -> None:
        """After ``idle_s`` seconds in which nothing moved: past the bound (``timeout_s`` while a receive waits,
        else twice that and a second), fail the scheduler and raise ``EPTimeoutError`` naming a waiting peer."""
        sched = self.sched
        waiting_rx = [p for p in sched.peers if self.done_rx[p] < self.nrx[p]]
        # a free send slot depends on the proxy, whose own bounds (credits, completions) name the cause
        # first; this host bound is the backstop of a proxy that stopped altogether
        if idle_s > (sched.timeout_s if waiting_rx else 2 * sched.timeout_s + 1.0):
            p = waiting_rx[0] if waiting_rx else next(p for p in sched.peers if self.pending(p))
            stage = STAGE_NAMES[int(F.STAGE_RING_CONSUME if waiting_rx else F.STAGE_RING_PRODUCE)]
            ex = EPTimeoutError(sched.rank, p, stage, sched.timeout_s)
            sched.fail(ex)
            raise ex


def host_alltoall(sched: Scheduler, sends: Mapping[int, np.ndarray],
                  recv_sizes: Mapping[int, int]) -> Dict[int, np.ndarray]:
    """Host producer and consumer of one all-to-all through ``sched``: ``sends[p]`` (uint8 bytes) goes to
    peer ``p``; ``recv_sizes[p]`` bytes come from each peer.  Its chunks are numbered by
    :meth:`Scheduler.reserve` (every rank must move the same chunks in the same order); it starts once every
    earlier chunk (a kernel's) was produced and consumed, so host and kernel chunks never overtake each other.

    Returns (once every chunk it wrote is placed at its peer): peer -> received uint8 array.

    Raises: the proxy's error; ``EPTimeoutError`` naming the peer and the stage when nothing moves for
    ``timeout_s``.
    """
    C = sched.slot_bytes
    ntx = {p: -(-len(sends.get(p, b"")) // C) for p in sched.peers}
    nrx = {p: -(-int(recv_sizes.get(p, 0)) // C) for p in sched.peers}
    tx0, rx0 = sched.reserve(ntx, nrx)
    for p in sched.peers:
        sched.wait_counter(RingFlags.READY, p, tx0[p], STAGE_NAMES[int(F.STAGE_RING_PRODUCE)])
        sched.wait_counter(RingFlags.HEAD, p, rx0[p], STAGE_NAMES[int(F.STAGE_RING_CONSUME)])
    xfer = _HostAlltoall(sched, sends, {p: np.empty(int(recv_sizes.get(p, 0)), np.uint8) for p in sched.peers},
                         ntx, nrx, tx0, rx0, {p: 0 for p in sched.peers}, {p: 0 for p in sched.peers})
    sched.waiting = "rdma host exchange (chunks to and from every peer)"
    try:
        _host_moves(sched, xfer)
    finally:
        sched.waiting = None
    return xfer.out


def _host_moves(sched: Scheduler, xfer: _HostAlltoall) -> None:
    """:func:`host_alltoall`'s loop: move what can move, nap while nothing does, up to the bound."""
    last = time.monotonic()
    idle = 0
    while any(xfer.pending(p) for p in sched.peers):
        sched.check()
        moved = False
        for p in sched.peers:
            moved |= xfer.move(p)
        now = time.monotonic()
        if moved:
            last, idle = now, 0
            continue
        xfer.check_stall(now - last)
        idle += 1
        time.sleep(0 if idle < 50 else 0.0002)


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


__all__ = ["Scheduler", "RingLayout", "ProxyError", "ProxyRemoteError", "PeerGoneError", "placed_error", "host_alltoall",
           "bootstrap",
           "fault_word", "parse_fault", "fault_gone", "is_chunk_signal", "TAG_CHUNK", "TAG_PROBE", "STAGE_NAMES"]


if __name__ == "__main__":
    # ``python -m triton_ep.scheduler``, the command's old name: this copy of the module runs the CLI's own module
    # as ``__main__`` (by name: the scheduler never imports its command, the command imports the scheduler the
    # package imported)
    import runpy
    runpy.run_module("triton_ep.scheduler_cli", run_name="__main__", alter_sys=True)
