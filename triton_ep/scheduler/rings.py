"""The host side of a :class:`~triton_ep.scheduler.Scheduler`'s rings: slot views, publishing and consuming
chunks, their numbering (:meth:`HostRings.reserve`, :meth:`HostRings.rebase`), and the host waits, bounded by
``timeout_s``, that raise the proxy's error."""
from __future__ import annotations

import time
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from triton_ep.errors import EPTimeoutError
from triton_ep.transport.ring_flags import RingFlags

from .faults import STAGE_NAMES, placed_error


class HostRings:
    """The producer and consumer calls of host code, and its waits (a part of the
    :class:`~triton_ep.scheduler.Scheduler`: its state is the scheduler's)."""

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
            st.gave_told = 0
            self.flags.clear_gave(peer)
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
