"""The token counts of a capture-path dispatch's RDMA peers (:class:`PeerTokens`), which size its staging areas.

The records a rank receives from a peer host are tokens of its RDMA peer there (the rank of the same local index),
each at most once: at most that peer's ``T``. The capture path sizes each staging area by the smaller of that bound
and ``C`` (the host's ranks' ``num_worst_tokens`` added up), so a ``num_worst_tokens`` far above the tokens (DeepEP's
customary ``T * R``) no longer sizes device memory. No device work tells the host a peer's ``T``, so the RDMA peers
post theirs in the process group's key-value store at each capture-path dispatch without a handle (a host wait for
the peers' keys, bounded by ``timeout_s``, ended at once by the network leg's failure; no device synchronisation, so
a CUDA graph still captures the call). Where the group has no store, or a peer took the host path for that call (it
says so in the store when its header exchange waits: :meth:`PeerTokens.mark_host_path`), the staging areas take
``C`` records as before. A peer that sends more records than the room it was given is still a capacity status (the
stream's header and the receiver's check are unchanged)."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional

from ...errors import EPTimeoutError
from ...runtime import STORE_CALL_S, StoreCaller

#: seconds a host-path header exchange waits before it tells a capture-path peer that it took the host path
MARK_AFTER_S = 0.5
#: seconds ``destroy()`` waits at most for the RDMA peers to close too (:meth:`PeerTokens.meet_at_close`)
CLOSE_MEET_S = 5.0
#: the value a rank on the host path posts instead of its token count
_HOST_PATH = -1


@dataclasses.dataclass
class PeerTokens:
    """This rank's side of the token-count exchange with its RDMA peers.

    Attributes:
        rank: this rank (global).  peers: the global ranks of its RDMA peers, one per other host.
        timeout_s: bound on the wait for the peers' keys.  store: the group's key-value store (``None``: none,
        every call then sizes by ``C``).  prefix: this Buffer's keys' prefix (the same on every rank).
        posted: call numbers whose key this rank posted and has not deleted yet.
        calls: the worker that makes the store calls that must not block for good (:meth:`mark_host_path`, those of
        ``destroy()``), each bounded; one reused from call to call, ended by :meth:`close`.
    """
    rank: int
    peers: List[int]
    timeout_s: float
    store: Optional[object] = None
    prefix: str = ""
    posted: List[int] = dataclasses.field(default_factory=list)
    calls: StoreCaller = dataclasses.field(default_factory=StoreCaller, repr=False, compare=False)

    def open(self, store, prefix: str) -> None:
        """Use ``store`` (``None``: none) under keys of ``prefix``."""
        self.store, self.prefix = store, prefix

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}tokens/{seq}/{rank}"

    def post(self, seq: int, num_tokens: int) -> None:
        """Post this rank's token count for its internode call ``seq`` (no-op without a store or peers)."""
        if self.store is not None and self.peers:
            self.store.set(self._key(seq, self.rank), str(int(num_tokens)))
            self.posted.append(seq)

    def mark_host_path(self, seq: int) -> None:
        """Call ``seq`` took the host path here: a peer waiting for this rank's count then sizes by ``C`` and sends
        its stream, which this rank's header exchange reads as a call of another kind. Never raises."""
        if self.store is None or not self.peers:
            return
        try:        # (a store call may block for good: bounded; then nothing more is asked of it)
            self.calls.call(lambda: self.post(seq, _HOST_PATH), STORE_CALL_S, "telling the RDMA peers")
        except TimeoutError:
            self.store = None
        except Exception:   # noqa: BLE001 - best effort: the peer then waits out its bound
            pass

    def gather(self, seq: int, check: Callable[[], None]) -> Optional[List[int]]:
        """The peers' token counts for call ``seq`` (in :attr:`peers` order), waiting for their keys; ``None``
        without a store, or where a peer took the host path. Once every peer posted ``seq`` it has read this rank's
        earlier keys, which are then deleted. ``check()`` runs between looks (it raises the network leg's failure).

        Raises:
            EPTimeoutError: a peer's key did not come within ``timeout_s`` (naming the peers still missing).
        """
        if self.store is None or not self.peers:
            return None
        keys = [self._key(seq, p) for p in self.peers]
        if not self._wait_for(keys, self.timeout_s, check):
            missing = [p for p, k in zip(self.peers, keys) if not self.store.check([k])]
            raise EPTimeoutError(self.rank, missing, "internode capture path: the RDMA peers' token counts",
                                 self.timeout_s)
        got = [int(self.store.get(k)) for k in keys]
        self.forget(below=seq)
        return None if _HOST_PATH in got else got

    def meet_at_close(self, bound_s: float, failed: Callable[[], bool]) -> float:
        """Before this rank's QPs go (``destroy()``): post that it is closing and wait until each RDMA peer posted
        the same, at most ``bound_s`` seconds, or until ``failed()`` (the proxy failed: nothing more will be written
        here). A rank whose call ended before its peer's (their rounds follow each one's own ``T``) so never closes
        under that peer's last writes for the call (the credits for this rank's last chunks), which would make the
        peer's proxy find it gone. A peer that never closes (gone, or keeping its Buffer) costs ``bound_s``; DeepEP's
        ``destroy`` waits for every rank without a bound. Returns the seconds waited. Never raises."""
        if self.store is None or not self.peers or failed():
            return 0.0
        t0 = time.monotonic()

        keys = [f"{self.prefix}closing/{p}" for p in self.peers]
        try:        # (a store call itself may block for good: bounded)
            self.calls.call(lambda: self.store.set(f"{self.prefix}closing/{self.rank}", "1"), STORE_CALL_S,
                            "destroy(): telling the RDMA peers")
            self.calls.call(lambda: self._wait_for(keys, bound_s, failed), bound_s + STORE_CALL_S,
                            "destroy(): meeting the RDMA peers")
        except TimeoutError:
            self.store = None       # (it does not answer: the keys stay, nothing more is asked of it)
        except Exception:   # noqa: BLE001 - the store may be gone (the process group destroyed first): close now
            pass
        return time.monotonic() - t0

    def _wait_for(self, keys: List[str], bound_s: float, stop: Callable[[], object]) -> bool:
        """Poll the store until every key of ``keys`` is there (True), or ``stop()`` is true or ``bound_s`` seconds
        passed (False). ``stop`` is called between looks and may raise instead."""
        deadline = time.monotonic() + bound_s
        looks = 0
        while not self.store.check(keys):
            if stop() or time.monotonic() > deadline:
                return False
            looks += 1
            time.sleep(0 if looks < 20 else 0.0005)
        return True

    def forget(self, below: Optional[int] = None) -> None:
        """Delete this rank's keys of calls before ``below`` (``None``: all of them, as the Buffer is destroyed: then
        bounded, :attr:`calls`). Never raises."""
        keep = [s for s in self.posted if below is not None and s >= below]
        drop = [s for s in self.posted if s not in keep]
        self.posted = keep

        def delete() -> None:
            for s in drop:
                try:
                    self.store.delete_key(self._key(s, self.rank))
                except Exception:   # noqa: BLE001 - a store without deletion keeps a few bytes
                    pass
        if not drop or self.store is None:
            return
        if below is not None:
            delete()
            return
        try:
            self.calls.call(delete, STORE_CALL_S, "destroy(): deleting the token counts' keys")
        except TimeoutError:
            self.store = None       # (it does not answer: the keys stay)

    def close(self) -> None:
        """End the worker of the bounded store calls (:attr:`calls`; a stuck one ends with its call). Never raises."""
        self.calls.close()
