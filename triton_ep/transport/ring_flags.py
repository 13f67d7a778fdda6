"""Host side of a scheduler ring's control block (:class:`RingFlags`) and a kernel's error record
(:class:`ErrorRecord`), importable without torch: the RDMA proxy process (:mod:`triton_ep.proxy_process`) imports
neither torch nor Triton. :mod:`triton_ep.transport.signals` re-exports both."""
from __future__ import annotations

from typing import NamedTuple, Optional

from ..errors import EPRemoteError, EPTimeoutError
from ..protocol import signal_header as F

#: names of the stages error records carry (one table, in the protocol)
STAGE_NAMES = F.STAGE_NAMES


class ErrorRecord(NamedTuple):
    """An error a kernel recorded: ``kind`` (``flags.E_*``), the ``peer`` it concerns, the ``stage``
    (``flags.STAGE_*``; for ``E_GONE`` the peer's stage) and the round ``call`` it happened in."""
    kind: int
    peer: int
    stage: int
    call: int


class RingFlags:
    """Host side of a scheduler ring's control block: chunk counters per peer (the layout and the device
    side are ``flags.RING_*``), the abort word, and the error record ring kernels write.

    Args:
        words: int64 numpy array ``[flags.ring_ctrl_words.host(R, S)]`` over the control block (registered host
            memory, pinned and device-mapped on GPU); the host reads and writes it without any device
            synchronisation (aligned 8-byte stores and loads are single accesses).
        rank, size: this rank and the group size ``R``; slots: ``S``, slots per peer.
    """

    READY, SENT, TAIL, HEAD = int(F.RING_READY), int(F.RING_SENT), int(F.RING_TAIL), int(F.RING_HEAD)
    CREDIT, FAULT, SRC = int(F.RING_CREDIT), int(F.RING_FAULT), int(F.RING_SRC)
    #: word index of the proxy's heartbeat (``RING_BEAT``): each sweep of a proxy thread stores its clock there
    BEAT = int(F.RING_BEAT)

    def __init__(self, words, rank: int, size: int, slots: int) -> None:
        self.w, self.rank, self.size, self.slots = words, rank, size, slots
        # the protocol's word indices, evaluated once: the proxy reads and writes these words in its hot loop
        self._word = {a: [F.ring_word.host(a, size, p) for p in range(size)]
                      for a in (self.READY, self.SENT, self.TAIL, self.HEAD, self.CREDIT, self.FAULT, self.SRC)}
        self._len = [[F.ring_len_word.host(size, slots, p, k) for k in range(slots)] for p in range(size)]
        self._masked = [F.ring_masked_word.host(size, slots, p) for p in range(size)]
        self._arrive0 = F.ring_arrive_word.host(size, slots, 0, 0)
        self._asrc = [[F.ring_asrc_word.host(size, slots, p, k) for k in range(slots)] for p in range(size)]
        self._gave = [F.ring_gave_word.host(size, slots, p) for p in range(size)]
        self._gsrc = [F.ring_gsrc_word.host(size, slots, p) for p in range(size)]

    def index(self, array: int, peer: int) -> int:
        """Word index of ``array[peer]``."""
        return self._word[array][peer]

    def rows(self) -> list:
        """The arrays ``READY`` to ``FAULT`` (adjacent in the block) as one list of ``6 * R`` ints, read at once:
        ``array[p]`` is item ``(array - READY) * R + p`` (the proxy's sweep reads these every pass)."""
        i = self._word[self.READY][0]
        return self.w[i:i + (self.FAULT - self.READY + 1) * self.size].tolist()

    def snapshot(self) -> list:
        """Every word the proxy's sweep reads, in one read of one numpy view (ascending addresses, so a chunk's
        ``LEN`` word is read after the ``READY`` word that released it): ``READY`` .. ``SRC``, ``LEN``, ``MASKED`` and
        ``ARRIVE``, as a list of ``7 R + 2 R S + R`` ints. Item indices: :meth:`rows`' for ``READY`` .. ``FAULT``, then
        :attr:`len0` ``+ peer * S + slot``, :attr:`masked0` ``+ peer``, :attr:`arrive0` ``+ peer * S + slot``."""
        return self.snapshot_view().tolist()

    def snapshot_view(self) -> "numpy.ndarray":
        """The int64 numpy view of the words :meth:`snapshot` reads (a view of the control block, not a copy: its
        ``tolist()`` is a fresh snapshot; the proxy's sweep keeps it from its start and reads it every pass)."""
        i = self._word[self.READY][0]
        return self.w[i:self._arrive0 + self.size * self.slots]

    @property
    def len0(self) -> int:
        """Index of ``LEN[0][0]`` in :meth:`snapshot`."""
        return self._len[0][0] - self._word[self.READY][0]

    @property
    def masked0(self) -> int:
        """Index of ``MASKED[0]`` in :meth:`snapshot`."""
        return self._masked[0] - self._word[self.READY][0]

    @property
    def arrive0(self) -> int:
        """Index of ``ARRIVE[0][0]`` in :meth:`snapshot`."""
        return self._arrive0 - self._word[self.READY][0]

    def arrivals(self) -> list:
        """The arrival words ``ARRIVE`` (``R * S`` ints, read at once): item ``peer * S + slot`` is ``k + 1`` once
        chunk ``k`` from ``peer`` (receive slot ``slot``) was placed, over RDMA, by a scheduler with arrival words."""
        i = self._arrive0
        return self.w[i:i + self.size * self.slots].tolist()

    def asrc_index(self, peer: int, seq: int) -> int:
        """Word index of ``ASRC`` for chunk ``seq`` to ``peer`` (its send slot's arrival-word source)."""
        return self._asrc[peer][seq % self.slots]

    def get(self, array: int, peer: int) -> int:
        """``array[peer]`` (a chunk count, or a fault word)."""
        return int(self.w[self._word[array][peer]])

    def put(self, array: int, peer: int, value: int) -> None:
        """Store ``array[peer] = value`` (x86 and CUDA host stores are not reordered with earlier ones)."""
        self.w[self._word[array][peer]] = value

    def set_len(self, peer: int, seq: int, nbytes: int) -> None:
        """Bytes of chunk ``seq`` for ``peer`` (written before ``READY`` moves past it)."""
        self.w[self._len[peer][seq % self.slots]] = nbytes

    def masked(self, peer: int) -> bool:
        """Whether ``peer`` is masked (low-latency rank masking: the proxy drops the chunks for it and returns the
        slots of its chunks as they arrive, which nothing consumes)."""
        return bool(self.w[self._masked[peer]])

    def mask(self, peer: int, on: bool = True) -> None:
        """Mask ``peer`` (kernels do the same with a store to ``MASKED[peer]``); ``on=False`` clears it (unmasking
        across hosts, once the rings with ``peer`` are renumbered: ``Scheduler.rebase``)."""
        self.w[self._masked[peer]] = 1 if on else 0

    def gave_up_on(self, peer: int) -> int:
        """``GSRC[peer]``: the low-latency call in which this rank's kernels gave up on ``peer`` (0: they did not)."""
        return int(self.w[self._gsrc[peer]])

    def gsrc_index(self, peer: int) -> int:
        """Word index of ``GSRC[peer]`` (the source of this rank's write into ``peer``'s ``GAVE[me]``)."""
        return self._gsrc[peer]

    def clear_gave(self, peer: int) -> None:
        """Forget the give-ups between this rank and ``peer`` (its ``GAVE`` and ``GSRC`` words: unmasking)."""
        self.w[self._gave[peer]] = 0
        self.w[self._gsrc[peer]] = 0

    def length(self, peer: int, seq: int) -> int:
        """Bytes of chunk ``seq`` for ``peer``, as its producer wrote them."""
        return int(self.w[self._len[peer][seq % self.slots]])

    def abort(self, value: int = 2) -> None:
        """Make every ring wait give up (kernels' and the host's): 1 means a timeout, 2 a failed proxy."""
        if self.w[int(F.RING_ABORT)] == 0:
            self.w[int(F.RING_ABORT)] = value

    def beat(self) -> int:
        """The proxy's heartbeat word (0 before its first sweep; it changes at every sweep, idle ones included)."""
        return int(self.w[self.BEAT])

    @property
    def aborted(self) -> int:
        """The abort word (0: none)."""
        return int(self.w[int(F.RING_ABORT)])

    def record(self) -> Optional[ErrorRecord]:
        """The error record a ring kernel wrote (``call`` holds the chunk number), or ``None``."""
        kind = int(self.w[int(F.RING_ERR_KIND)])
        if not kind:
            return None
        return ErrorRecord(kind, int(self.w[int(F.RING_ERR_PEER)]) - 1, int(self.w[int(F.RING_ERR_STAGE)]),
                           int(self.w[int(F.RING_ERR_SEQ)]))

    def error(self, timeout_s: float) -> Optional[BaseException]:
        """The exception a kernel's record stands for: ``EPTimeoutError`` (the stage names the chunk), or
        ``EPRemoteError`` when the wait ended because the proxy failed (its own error says why)."""
        rec = self.record()
        if rec is None:
            return None
        stage = STAGE_NAMES.get(rec.stage, "rdma ring")
        if rec.kind == int(F.E_TIMEOUT):
            return EPTimeoutError(self.rank, rec.peer, f"{stage} (chunk {rec.call})", timeout_s)
        return EPRemoteError(f"rank {self.rank}: a kernel's wait for peer {rec.peer} at '{stage}' (chunk "
                             f"{rec.call}) ended because the RDMA proxy failed")
