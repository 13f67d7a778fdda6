"""The byte layout of a rank's scheduler region (:class:`RingLayout`) and the proxy's book-keeping per QP and per
peer over it."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Tuple

from triton_ep.protocol import signal_header as F


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
    parked: bool = False    # out of its port's list of QPs with room: its window is full
    #: its port's list of QPs with room, the picker's (:meth:`Scheduler._room`), and its port's ``[outstanding,
    #: total]`` bytes
    room: Optional[list] = None
    port_w: Optional[List[int]] = None
    #: its peer's state (:class:`_PeerState`) and the word index of ``SENT[peer]``, for the completions' path
    peer_state: Optional["_PeerState"] = None
    i_sent: int = 0


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
    #: the give-up call this rank's proxy wrote into the peer's ``GAVE[me]`` (0: none yet;
    #: :meth:`ChunkPosting._tell_gave_up`)
    gave_told: int = 0
