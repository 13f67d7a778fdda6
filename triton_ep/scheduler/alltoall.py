"""A host producer and consumer of one all-to-all through a :class:`~triton_ep.scheduler.Scheduler`'s rings
(:func:`host_alltoall`): the modes' small exchanges across hosts, and the scheduler's command."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional

import numpy as np

from triton_ep.errors import EPTimeoutError
from triton_ep.protocol import signal_header as F
from triton_ep.transport.ring_flags import RingFlags

from .core import Scheduler
from .faults import STAGE_NAMES


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


def host_alltoall(sched: Scheduler, sends: Mapping[int, np.ndarray], recv_sizes: Mapping[int, int],
                  on_idle: Optional[Callable[[float], None]] = None) -> Dict[int, np.ndarray]:
    """Host producer and consumer of one all-to-all through ``sched``: ``sends[p]`` (uint8 bytes) goes to
    peer ``p``; ``recv_sizes[p]`` bytes come from each peer.  Its chunks are numbered by
    :meth:`Scheduler.reserve` (every rank must move the same chunks in the same order); it starts once every
    earlier chunk (a kernel's) was produced and consumed, so host and kernel chunks never overtake each other.

    ``on_idle(seconds)``, where given, is called while nothing moves, with the seconds since the exchange began.

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
        _host_moves(sched, xfer, on_idle)
    finally:
        sched.waiting = None
    return xfer.out


def _host_moves(sched: Scheduler, xfer: _HostAlltoall, on_idle: Optional[Callable[[float], None]]) -> None:
    """:func:`host_alltoall`'s loop: move what can move, nap while nothing does, up to the bound."""
    start = last = time.monotonic()
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
        if on_idle is not None:
            on_idle(now - start)
        idle += 1
        time.sleep(0 if idle < 50 else 0.0002)
