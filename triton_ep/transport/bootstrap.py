"""Bounded bootstrap exchanges over a process group that leave nothing pending.

Building a Buffer (and connecting RDMA queue pairs) needs one all-gather of small Python objects (buffer
handles, addresses, sizes). A collective on the caller's group cannot be bounded cleanly: if a rank never
arrives, an all-gather that timed out on the host stays pending in the backend (gloo keeps waiting, and
``destroy_process_group()`` and interpreter exit wait for it, 30 minutes by default; NCCL's watchdog
would end the process). So the exchange goes through the group's key-value store instead
(``ProcessGroup.get_group_store()``, the store torch itself rendezvoused the group through; it works the
same for gloo and NCCL groups, subgroups made by ``new_group``, and ranks on several hosts):

- every rank sets its key ``triton_ep/<exchange>/<rank>`` and polls (non-blocking ``check``) until every
  rank's key is there, up to ``timeout_s``;
- a rank that gives up (timeout, or bad arguments before the exchange: :meth:`Exchange.fail`) sets the
  exchange's ``abort`` key with its reason, so a late peer raises at once instead of waiting out its own
  bound;
- the last rank to finish reading removes the exchange's keys.

A timeout names every rank that did not arrive. Nothing blocks afterwards: no collective is pending, no
thread was started. Exchanges are numbered per group in call order (every rank of a group builds its
Buffers in the same order, as DeepEP requires).

Where torch has no ``ProcessGroup.get_group_store``, the exchange falls back to an all-gather with a
bounded wait, which may leave the collective pending after a timeout (documented in docs/design.md).
"""
from __future__ import annotations

import datetime
import pickle
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..errors import EPRemoteError, EPTimeoutError

_PREFIX = "triton_ep"
#: exchanges started per group (by group name), this process
_counts: Dict[str, int] = {}


def _group_store(group) -> Optional[Any]:
    """The group's store, or ``None`` where torch does not expose it."""
    get = getattr(group, "get_group_store", None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, NotImplementedError):
        return None


#: seconds a store call made while a Buffer is destroyed may take (:func:`bounded_store_call`)
STORE_CALL_S = 2.0
#: seconds a :class:`StoreCaller`'s worker waits idle for its next call before it ends (the next call starts another)
STORE_WORKER_IDLE_S = 10.0


class _Worker:
    """One :class:`StoreCaller` worker: its thread and the queue of the calls handed to it (``None``: end)."""

    def __init__(self, owner: "StoreCaller") -> None:
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.stuck = False      # (inside a call that passed its bound: no call is handed to it any more)
        self.thread = threading.Thread(target=self._serve, args=(owner,), name="triton-ep-store-call", daemon=True)
        self.thread.start()

    def _serve(self, owner: "StoreCaller") -> None:
        while True:
            try:
                job = self.jobs.get(timeout=STORE_WORKER_IDLE_S)
            except queue.Empty:
                if owner._retire(self):
                    return
                continue
            if job is None:
                return
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as ex:     # noqa: BLE001 - handed to the caller
                box["error"] = ex
            finally:
                done.set()


class StoreCaller:
    """Calls on a group's store (``fn()``), each bounded: its result, or its exception, or ``TimeoutError`` after
    ``bound_s`` seconds (:meth:`call`). A ``TCPStore`` whose server's process died while another process holds its
    sockets (a process forked from the server's rank, e.g. a data-loader worker) accepts requests and never answers
    them: its client calls (``check``, ``add``, ``get``, ``set``) then block for good, whatever the store's timeout
    (a ``check`` blocked more than 5 s with a timeout of 1 s). So each call runs in a worker thread, the caller waits
    for it at most ``bound_s``: one worker reused from call to call (a ``TCPStore.set`` through it took 34-104 µs, through
    a thread started per call 260-390 µs, directly 2-19 µs, on 2 cores at a load of 7-8), started at the first call; one stuck in a call that passed its bound
    is left to end with that call (a daemon thread; the store's connection ends with the last process holding it)
    and the next call starts another. A worker idle for :data:`STORE_WORKER_IDLE_S` ends (the next call starts
    another); :meth:`close` ends it at once. Calls are made one at a time (a second caller waits for the first, within
    its own bound). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker: Optional[_Worker] = None

    def call(self, fn, bound_s: float = STORE_CALL_S, what: str = "a store call") -> Any:
        """``fn()``'s result, made by the worker within ``bound_s`` seconds.

        Raises:
            TimeoutError: no answer within ``bound_s`` (``what`` names the call), or another caller's call held the
                worker that long. Whatever ``fn()`` raised.
        """
        t0 = time.monotonic()
        if not self._lock.acquire(timeout=max(bound_s, 0.0)):
            raise TimeoutError(f"{what}: another store call of this rank did not end within {bound_s:g} s")
        try:
            w = self._worker
            if w is None or not w.thread.is_alive() or w.stuck:
                w = self._worker = _Worker(self)
            box: Dict[str, Any] = {}
            done = threading.Event()
            w.jobs.put((fn, box, done))
            if not done.wait(max(0.0, bound_s - (time.monotonic() - t0))):
                w.stuck = True
                w.jobs.put(None)        # (it ends once that call returns)
                raise TimeoutError(f"{what}: the group's store did not answer within {bound_s:g} s (its server's "
                                   f"process may be gone while another process holds its sockets)")
        finally:
            self._lock.release()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _retire(self, w: _Worker) -> bool:
        """Whether worker ``w``, idle for :data:`STORE_WORKER_IDLE_S`, ends now: yes unless a call is being handed to
        it (the lock is held); it is then no longer this caller's worker."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._worker is w:
                self._worker = None
            return True
        finally:
            self._lock.release()

    def close(self, join_s: float = 1.0) -> None:
        """End the worker: an idle one at once (joined, at most ``join_s``), a stuck one is left to end with its call.
        The next :meth:`call` starts another. Never raises; idempotent."""
        with self._lock:
            w, self._worker = self._worker, None
        if w is None:
            return
        w.jobs.put(None)
        if not w.stuck and w.thread is not threading.current_thread():
            w.thread.join(join_s)


def bounded_store_call(fn, bound_s: float = STORE_CALL_S, what: str = "a store call") -> Any:
    """``fn()`` (calls on a group's store), bounded as :meth:`StoreCaller.call` bounds it, by a worker thread of its
    own that ends with the call (a caller that makes such calls often keeps a :class:`StoreCaller`)."""
    caller = StoreCaller()
    try:
        return caller.call(fn, bound_s, what)
    finally:
        caller.close()


class _ExchangeStore:
    """A group's store as :class:`Exchange` calls it: ``set``, ``get``, ``check``, ``add`` and ``delete_key`` pass
    through, and a call that fails because the store is gone (torch's ``DistError`` family, e.g.
    ``DistNetworkError: Broken pipe`` once the process serving it, the group's rank 0, has exited; a socket error)
    raises :class:`~triton_ep.errors.EPRemoteError` naming the exchange, with the store's first line only (torch's
    message goes on with its C++ frames)."""

    __slots__ = ("store", "rank", "stage")

    def __init__(self, store, rank: int, stage: str) -> None:
        self.store, self.rank, self.stage = store, rank, stage

    def _call(self, name: str, *args):
        try:
            return getattr(self.store, name)(*args)
        except (RuntimeError, OSError) as e:
            dist_error = getattr(dist, "DistError", None)
            if not (isinstance(e, OSError) or (dist_error is not None and isinstance(e, dist_error))):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise EPRemoteError(f"rank {self.rank}: the group's store stopped answering at '{self.stage}' "
                                f"({type(e).__name__}: {first}): the process serving it (torch.distributed's rank 0) "
                                f"may have exited; this rank's Buffer was not built") from None

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def check(self, keys):
        return self._call("check", keys)

    def add(self, key, n):
        return self._call("add", key, n)

    def delete_key(self, key):
        return self._call("delete_key", key)


class Exchange:
    """One bounded all-gather of picklable objects over ``group`` (collective: every rank makes it).

    Create it at the start of the collective step (so a rank that fails before it can still
    :meth:`fail`); then :meth:`gather` once.

    Args:
        group: a ``torch.distributed`` process group (any backend).
        timeout_s: bound in seconds on the wait for every rank.
        stage: what the ranks exchange, named in errors (e.g. ``"bootstrap: exchange buffer handles"``).
    """

    def __init__(self, group, timeout_s: float, stage: str) -> None:
        self.group, self.timeout_s, self.stage = group, float(timeout_s), stage
        self.rank, self.size = group.rank(), group.size()
        store = _group_store(group)
        self.store = None if store is None else _ExchangeStore(store, self.rank, stage)
        name = str(getattr(group, "group_name", id(group)))
        n = _counts[name] = _counts.get(name, 0) + 1
        self.base = f"{_PREFIX}/{n}/"
        self._done = False

    def _key(self, r: int) -> str:
        return f"{self.base}{r}"

    def fail(self, why: str, timed_out: bool = False) -> None:
        """This rank will not take part (``timed_out``: it gave up waiting for peers; else it rejected its
        arguments or failed): say so where the peers look, so they raise at once. Never raises.

        The ``abort`` key holds ``T`` or ``F`` (timed out or failed), then the reason."""
        if self.store is None or self._done:
            return
        self._done = True
        try:
            if not self.store.check([self.base + "abort"]):
                self.store.set(self.base + "abort", f"{'T' if timed_out else 'F'}rank {self.rank} {why}")
        except Exception:   # noqa: BLE001 - the store may be gone (the job is ending); the peers time out
            pass

    def _missing(self, keys: List[str]) -> List[int]:
        """The ranks whose key is not in the store yet."""
        return [r for r in range(self.size) if not self.store.check([keys[r]])]

    def _gave_up(self, keys: List[str], abort: str) -> None:
        """A peer gave up on this exchange (its ``abort`` key, see :meth:`fail`): raise ``EPTimeoutError``
        naming the ranks this rank is still missing too when the peer timed out (the same absent peer), else
        ``EPRemoteError`` (this rank came late, or the peer failed)."""
        self._done = True
        timed_out, why = abort[0] == "T", abort[1:]
        missing = self._missing(keys)
        if missing and timed_out:
            raise EPTimeoutError(self.rank, missing, f"{self.stage} ({why})", self.timeout_s)
        raise EPRemoteError(f"rank {self.rank}: {why} at '{self.stage}'; this rank's Buffer was not built")

    def gather(self, obj: Any, check: Optional[Callable[[], None]] = None) -> List[Any]:
        """Every rank's ``obj``, in rank order. ``check``: called at each look at the store while this rank waits
        (a few milliseconds apart; it must be cheap), to raise an error this rank learns of meanwhile, e.g. its RDMA
        proxy's, which a peer that will not come caused (its proxy stopped, told through the group's store), instead
        of waiting out ``timeout_s`` for that peer. The exchange is not given up (:meth:`fail`): the other ranks
        waiting learn of that error as this one did and raise it themselves (a peer's given-up exchange would be an
        ``EPRemoteError`` quoting this rank, where they should name the root cause).

        Raises:
            EPTimeoutError: ranks did not arrive within ``timeout_s``; it names all of them (``peer`` is the
                first, ``peers`` the list).
            EPRemoteError: a peer gave up or failed before the exchange (its reason is quoted), or the group's
                store stopped answering (its server's process, rank 0's, exited).
            what ``check`` raises.
        """
        if self.store is None:
            return _gather_collective(self.group, obj, self.timeout_s, self.stage)
        store, keys = self.store, [self._key(r) for r in range(self.size)]
        store.set(keys[self.rank], pickle.dumps(obj))
        start = time.monotonic()
        deadline = start + self.timeout_s
        abort = self.base + "abort"
        while True:
            if check is not None:
                check()
            arrived = store.check(keys)
            if store.check([abort]):
                self._gave_up(keys, store.get(abort).decode())
            if arrived:
                break
            now = time.monotonic()
            if now > deadline:
                missing = self._missing(keys)
                if not missing:          # they all arrived just now
                    break
                self.fail(f"gave up waiting for rank(s) {', '.join(map(str, missing))} after {self.timeout_s:.3g} s",
                          timed_out=True)
                raise EPTimeoutError(self.rank, missing, self.stage, self.timeout_s)
            # yield the core at first (peers usually arrive within milliseconds), then nap
            time.sleep(0.0005 if now - start < 0.05 else 0.005)
        out = [pickle.loads(store.get(k)) for k in keys]
        self._done = True
        if store.add(self.base + "read", 1) == self.size:        # the last reader cleans up
            for k in keys + [self.base + "read"]:
                try:
                    store.delete_key(k)
                except Exception:   # noqa: BLE001 - a store without delete (FileStore of old torch): keys stay
                    pass
        return out


def gather_objects(group, obj: Any, timeout_s: float, stage: str,
                   check: Optional[Callable[[], None]] = None) -> List[Any]:
    """``all_gather_object`` over ``group`` with a bound (see :class:`Exchange`): picklable ``obj`` from every
    rank, in rank order. ``check``: see :meth:`Exchange.gather` (looked at while this rank waits for its peers).

    Raises:
        EPTimeoutError: not every rank joined within ``timeout_s`` seconds (naming those that did not).
        EPRemoteError: a peer gave up or failed before the exchange.
        what ``check`` raises.
    """
    return Exchange(group, timeout_s, stage).gather(obj, check)


def _gather_collective(group, obj: Any, timeout_s: float, stage: str) -> List[Any]:
    """The fallback where torch exposes no group store: two all-gathers with a bounded host wait (the
    collective may stay pending after a timeout)."""
    rank, size = group.rank(), group.size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    def gather(t: torch.Tensor) -> List[torch.Tensor]:
        outs = [torch.empty_like(t) for _ in range(size)]
        t0 = time.monotonic()
        work = dist.all_gather(outs, t, group=group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if time.monotonic() - t0 < 0.9 * timeout_s:      # not a timeout: a peer's process failed
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise EPRemoteError(f"rank {rank}: a peer failed at '{stage}' (it could not build its Buffer, or "
                                    f"its process ended); the process group reported: {first}") from None
            raise EPTimeoutError(rank, None, stage, timeout_s) from None
        return outs

    sizes = [int(s.item()) for s in gather(torch.tensor([payload.numel()], dtype=torch.int64, device=dev))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    padded[:payload.numel()] = payload.to(dev)
    return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(gather(padded), sizes)]
