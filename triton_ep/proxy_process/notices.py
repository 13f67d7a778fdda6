"""A dead proxy process's fault notice (:class:`FaultNotices`), given by its rank's process through the group's
key-value store, since the dead proxy writes no fault word."""
from __future__ import annotations

import pickle
import threading
from typing import Sequence

#: seconds between a rank's looks at the group's store for a peer whose proxy process died (:class:`FaultNotices`)
FAULT_POLL_S = 0.25
#: seconds :meth:`FaultNotices.look` waits at most for the store (a look takes a few milliseconds)
LOOK_BOUND_S = 1.0
#: seconds :meth:`FaultNotices.close` waits at most for its thread (a look at the store takes a millisecond)
CLOSE_JOIN_S = 0.5 + FAULT_POLL_S


class FaultNotices:
    """A dead proxy process's fault notice, given by its rank's process through the group's key-value store.

    A failing proxy (thread or process) writes its fault word into each peer's ``FAULT`` slot over RDMA, so the
    peers raise :class:`~triton_ep.scheduler.ProxyRemoteError` at once. A proxy process that dies (SIGKILL, the OOM
    killer) writes nothing, and the rank's process has no QP to write it with; so the rank's process posts the same
    word in the group's store (``<prefix><rank>``: the word and why, then ``<prefix>count`` goes up by one), and
    each rank's process looks at ``<prefix>count`` every :data:`FAULT_POLL_S` (one store request; a thread that
    ends with :meth:`close`). A peer's notice fails this rank's scheduler with ``ProxyRemoteError`` naming that peer,
    as its fault word would have, unless the peer is masked (as a masked peer's fault word is ignored).

    Args:
        store: the group's store (``torch.distributed.Store``).  prefix: the keys' prefix, the same on every rank
            of the network leg.  rank: this rank (in the leg).  peers: the ranks whose notices it heeds (every other
            rank of the leg, those it has no QP to included).
        on_fault: ``f(peer, word, why)`` called in the watching thread for each peer's notice, once.
    """

    def __init__(self, store, prefix: str, rank: int, peers: Sequence[int], on_fault) -> None:
        self.store, self.prefix, self.rank, self.peers, self.on_fault = store, prefix, rank, list(peers), on_fault
        self._stop = threading.Event()
        self._heard: set = set()
        #: the notice count last looked at, under ``_lock`` (the thread and :meth:`look` take turns)
        self._seen, self._lock = 0, threading.Lock()
        self._thread = threading.Thread(target=self._watch, name=f"triton-ep-proxy-faults-{rank}", daemon=True)
        self._thread.start()

    def post(self, word: int, why: str) -> None:
        """Tell the peers that this rank's proxy failed with fault ``word`` (:func:`~triton_ep.scheduler.fault_word`)
        because ``why``. Never raises (the store may be gone: the job is ending)."""
        try:
            self.store.set(f"{self.prefix}{self.rank}", pickle.dumps((int(word), str(why))))
            self.store.add(f"{self.prefix}count", 1)
        except Exception:   # noqa: BLE001
            pass

    def look(self, bound_s: float = LOOK_BOUND_S) -> None:
        """Look at the store now, as the watching thread does every :data:`FAULT_POLL_S`: ``on_fault`` is called for
        each peer's notice not heard yet before this returns. For an error path that must not miss a notice already
        posted: a host mate's failure word ended this rank's wait, and its rank posts the notice before its kernels
        can write that word (:meth:`~.rank_side.ProcessScheduler._record`). Bounded by ``bound_s`` (a worker thread
        makes the store calls, :func:`~triton_ep.transport.bootstrap.bounded_store_call`; the watching thread's look
        in progress is waited for within it).

        Raises:
            TimeoutError: no answer within ``bound_s``. What the store raises."""
        from triton_ep.transport.bootstrap import bounded_store_call     # (torch: not in the proxy process)
        bounded_store_call(self._look, bound_s, "a look at the peers' proxy fault notices")

    def _look(self) -> bool:
        """One look (the thread's or :meth:`look`'s: one at a time, each notice heard once). Returns whether this
        side has stopped looking."""
        with self._lock:
            n = self.store.add(f"{self.prefix}count", 0)
            if self._stop.is_set():
                return True
            if n <= self._seen:
                return False
            self._seen = n
            for p in self.peers:
                key = f"{self.prefix}{p}"
                if p not in self._heard and self.store.check([key]):
                    self._heard.add(p)
                    word, why = pickle.loads(self.store.get(key))
                    self.on_fault(p, word, why)
        return False

    def _watch(self) -> None:
        while not self._stop.wait(FAULT_POLL_S):
            try:
                if self._look():
                    return
            except Exception:   # noqa: BLE001  (the store is gone: the job is ending; peers' own bounds stand)
                return

    def close(self) -> None:
        """Stop looking (joins the thread, at most :data:`CLOSE_JOIN_S`; idempotent). A thread inside a store call that
        does not return (a ``TCPStore`` whose server's process died while a process forked from it holds its sockets)
        is left to end with that call (a daemon thread; it calls nothing more)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_JOIN_S)
