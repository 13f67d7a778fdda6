"""Which ranks of one host still live: a lock each rank holds for its Buffer's lifetime, which the kernel
releases when the process ends, however it ends (SIGKILL included).

At set-up (:func:`triton_ep.transport.ipc.open_group`) the first rank makes a small *liveness file* next to
the shared buffers, every rank opens it and takes an open-file-description lock (Linux ``F_OFD_SETLK``) on
its own byte of it; the file's name is unlinked once every rank has it open, so nothing stays in
``/dev/shm`` even when a process is killed. A peer whose byte is no longer locked (``F_OFD_GETLK``: a query
that takes nothing) has either destroyed its Buffer, which first writes into its byte whether it closed cleanly
(:data:`CLOSED` and its kin), or its process is gone (:data:`DEAD`). Locks are on the file, not on process ids: PID
namespaces (containers sharing ``/dev/shm``) do not matter. A process that forks after the set-up (a data loader's
workers) closes its copy of the descriptor in the child, so a child never keeps a dead parent's lock alive.

:meth:`Liveness.watch` starts the watcher: one daemon thread per Buffer that polls the peers' locks every
:data:`POLL_S` seconds (``R - 1`` ``fcntl`` calls, a few microseconds) and reports each peer found dead once;
the Runtime turns that into the ``DEAD`` words the kernels' waits read (:mod:`triton_ep.kernels.flags`). Where a
peer's clean close ends the waits for it too (:attr:`Liveness.closes_leave`: a Buffer's own group within one host), it
also reports each peer found closed once, which the Runtime writes into the same words. Host waits ask
:meth:`Liveness.left_peers` (or :meth:`Liveness.dead_peers`) themselves. Where ``F_OFD_GETLK`` does not exist (not
Linux), :func:`supported` is False and dead or closed peers are seen at ``timeout_s`` as before.
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import weakref
from typing import Callable, Dict, Iterable, Optional

from ..errors import EPRemoteError

#: seconds between two looks at the peers' locks (the watcher thread)
POLL_S = 0.1
#: ``struct flock`` on Linux (x86-64 and aarch64): l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_FLOCK = "hhqqi4x"
_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", None)
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
#: how a peer left, from its byte once its lock is free: its process is gone (0: :data:`DEAD`), or it destroyed its
#: Buffer, which writes the byte first: with no error pending (:data:`CLOSED`), after an error of its last call that
#: it raised and told its peers of (:data:`CLOSED_FAILED`), or with its Buffer broken (:data:`CLOSED_BROKEN`: it timed
#: out, left the group, or saw a peer gone)
DEAD, CLOSED, CLOSED_FAILED, CLOSED_BROKEN = "dead", "closed", "closed after an error", "closed broken"
_BYTES = {CLOSED: 1, CLOSED_FAILED: 2, CLOSED_BROKEN: 3}
_HOW = {b: how for how, b in _BYTES.items()}

#: live objects, whose descriptors a forked child closes (weak: a dropped Buffer's goes)
_open: "weakref.WeakSet[Liveness]" = weakref.WeakSet()


def supported() -> bool:
    """Whether this platform has open-file-description locks (Linux 3.15+)."""
    return _OFD_GETLK is not None


def _flock(kind: int, start: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, 1, 0)


def lock_byte(fd: int, byte: int) -> None:
    """Take an open-file-description write lock on byte ``byte`` of the file ``fd`` (released when the last
    descriptor of that open file description closes: at the process's end, however it ends).

    Raises:
        BlockingIOError: another open file description holds it. OSError: not supported (see :func:`supported`)."""
    if _OFD_SETLK is None:
        raise OSError("open-file-description locks (F_OFD_SETLK) are not available on this platform")
    fcntl.fcntl(fd, _OFD_SETLK, _flock(fcntl.F_WRLCK, byte))


def byte_locked(fd: int, byte: int) -> bool:
    """Whether another open file description than ``fd``'s holds a lock on byte ``byte`` of the file (a query:
    ``F_OFD_GETLK`` takes nothing)."""
    got = fcntl.fcntl(fd, _OFD_GETLK, _flock(fcntl.F_WRLCK, byte))
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK


def drop_descriptor(holder) -> None:
    """Close ``holder.fd`` (a descriptor of a lock file: a :class:`Liveness`'s, an emulated QP ring's) and set it to
    None, first, so that nothing uses it again; a failing close is ignored (the descriptor is gone either way).
    Idempotent. The kernel releases a lock once the last descriptor of its open file description closes."""
    fd, holder.fd = holder.fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _after_fork_in_child() -> None:
    for live in list(_open):
        live._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def dead_error(rank: int, dead: Iterable[int], stage: str) -> EPRemoteError:
    """The error a rank raises when ranks ``dead`` of its host are gone while it waits at ``stage``: an
    ``EPRemoteError`` whose ``failed_rank`` is the first dead rank, ``dead_ranks`` all of them, ``stage`` the
    wait's stage."""
    dead = sorted(dead)
    who = f"rank {dead[0]}'s process is" if len(dead) == 1 else f"the processes of ranks {dead} are"
    ex = EPRemoteError(f"rank {rank}: {who} gone (killed, crashed or exited without destroying its Buffer) while "
                       f"this rank waited at stage '{stage}'; this call's outputs here are not valid; destroy() "
                       f"and rebuild the Buffer")
    ex.failed_rank, ex.dead_ranks, ex.stage = dead[0], dead, stage
    return ex


#: what a peer that released its Buffer after an error did, by how it left (:data:`CLOSED_FAILED`, :data:`CLOSED_BROKEN`)
_AFTER = {CLOSED_FAILED: "released its Buffer after an error of its own (a call that raised, or a Buffer it failed "
                         "to build: a timeout or a bad value while building it)",
          CLOSED_BROKEN: "released its Buffer after it broke (it timed out, left the group or saw a peer gone)"}


def closed_error(rank: int, closed: Iterable[int], stage: str, first: Optional[int] = None,
                 how: Optional[Dict[int, str]] = None) -> EPRemoteError:
    """The error a rank raises when ranks ``closed`` of its host destroyed their Buffer (their processes may live on)
    while it waits at ``stage``: an ``EPRemoteError`` whose ``failed_rank`` is ``first`` (where it is one of them, else
    the lowest), ``closed_ranks`` all of them, ``stage`` the wait's stage. ``how`` (``{peer: how it left}``, where
    known): a first rank that left after an error of its own (:data:`CLOSED_FAILED`, :data:`CLOSED_BROKEN`) is named
    so, not as a ``destroy()``."""
    closed = sorted(closed)
    first = first if first in closed else closed[0]
    after = _AFTER.get((how or {}).get(first))
    if after is not None:
        what = f"rank {first} {after} while this rank waited at stage '{stage}'"
    else:
        who = f"rank {first} destroyed its Buffer" if len(closed) == 1 else f"ranks {closed} destroyed their Buffers"
        what = (f"{who} (destroy()) while this rank waited at stage '{stage}' (a Buffer collected or released at its "
                f"process's exit counts too; not a crash)")
    ex = EPRemoteError(f"rank {rank}: {what}; this call's outputs here are not valid; destroy() and rebuild the Buffer")
    ex.failed_rank, ex.closed_ranks, ex.stage = first, closed, stage
    return ex


def left_phrase(left: Dict[int, str]) -> str:
    """A few words on the first of peers ``left`` (``{peer: how}``, not empty; a dead one first): ``"rank 1's process
    is gone"`` or ``"rank 1 destroyed its Buffer"`` (what a broken Comm says it broke on)."""
    dead = sorted(p for p, how in left.items() if how == DEAD)
    return f"rank {dead[0]}'s process is gone" if dead else f"rank {min(left)} destroyed its Buffer"


def left_error(rank: int, left: Dict[int, str], stage: str) -> EPRemoteError:
    """The error for peers ``left`` (``{peer: how}``, not empty) that left while this rank waited at ``stage`` (a host
    wait): :func:`dead_error` naming the dead ones where there are any (a death is the cause to name), else
    :func:`closed_error`."""
    dead = [p for p, how in left.items() if how == DEAD]
    return dead_error(rank, dead, stage) if dead else closed_error(rank, list(left), stage, how=left)


class Liveness:
    """One rank's side of its group's liveness file.

    Args:
        path: the file (made by the first rank with ``create``, which sizes it to ``size`` bytes).
        rank, size: this rank and the group size ``R``.

    Raises:
        OSError: the file cannot be opened or made; ``BlockingIOError`` when this rank's byte is locked already.
    """

    def __init__(self, path: str, rank: int, size: int, create: bool) -> None:
        self.rank, self.size = rank, size
        self.fd: Optional[int] = None
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            lock_byte(fd, rank)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        #: peers found gone so far, ``{peer: how}`` (:data:`DEAD`, :data:`CLOSED`...; sticky: a dead process stays dead,
        #: a closed rank's byte stays as it wrote it)
        self.left: Dict[int, str] = {}
        #: whether a peer that destroyed its Buffer counts as having left (:meth:`left_peers`, the watcher's
        #: ``on_closed``): set by the Runtime of a Buffer within one host, where nothing else would tell its peers
        #: (across hosts the close words do); otherwise only dead peers count and a closed one is waited for
        self.closes_leave = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        _open.add(self)

    @staticmethod
    def _held(fd: int, peer: int) -> bool:
        """Whether ``peer``'s byte is locked (by its process: this rank's own descriptor holds only its byte)."""
        return byte_locked(fd, peer)

    def _look(self, peers: Optional[Iterable[int]]) -> Dict[int, str]:
        """Look at the locks of ``peers`` (default: all) not yet found gone; ``{peer: how}`` of those (of ``peers``)
        found gone so far. A locked byte is a live peer (one that is closing writes its byte before it releases its
        lock); a free one says how it left (:data:`CLOSED` and its kin), or holds 0: :data:`DEAD`. Empty once
        closed."""
        fd = self.fd
        if fd is None:
            return {}
        for p in range(self.size) if peers is None else peers:
            if p != self.rank and p not in self.left and not self._held(fd, p):
                b = os.pread(fd, 1, p)
                self.left[p] = _HOW.get(b[0], DEAD) if b else DEAD
        return {p: how for p, how in self.left.items() if peers is None or p in peers}

    def dead_peers(self, peers: Optional[Iterable[int]] = None) -> Dict[int, str]:
        """``{peer: "dead"}`` of the peers (default: all) whose process is gone, looked at now (a peer that
        destroyed its Buffer is not dead). Empty once closed."""
        return {p: how for p, how in self._look(peers).items() if how == DEAD}

    def left_peers(self, peers: Optional[Iterable[int]] = None) -> Dict[int, str]:
        """``{peer: how}`` of the peers (default: all) that left, looked at now: the dead ones, and those that
        destroyed their Buffer where :attr:`closes_leave` (:data:`CLOSED` and its kin). Empty once closed."""
        return {p: how for p, how in self._look(peers).items() if how == DEAD or self.closes_leave}

    def watch(self, on_dead: Callable[[int], None], poll_s: float = POLL_S,
              on_closed: Optional[Callable[[int, str], None]] = None) -> None:
        """Start the watcher thread: every ``poll_s`` seconds it looks at every peer's lock and calls
        ``on_dead(peer)`` once for each peer found dead, and ``on_closed(peer, how)`` (where given) once for each peer
        found to have destroyed its Buffer (``how``: :data:`CLOSED` and its kin), from that thread; neither may raise,
        and they should hold no reference to what owns this object. It stops at :meth:`close`."""
        if self._thread is not None or self.size < 2:
            return
        stop, told = self._stop, set()

        def run() -> None:
            while not stop.wait(poll_s):
                try:
                    left = self._look(None)
                except OSError:         # closed under us (close() races the look): stop
                    return
                for p, how in left.items():
                    if p not in told and (how == DEAD or on_closed is not None):
                        told.add(p)
                        if how == DEAD:
                            on_dead(p)
                        else:
                            on_closed(p, how)

        self._thread = threading.Thread(target=run, name=f"triton-ep-liveness-r{self.rank}", daemon=True)
        self._thread.start()

    def close(self, orderly: bool = True, how: str = CLOSED) -> None:
        """Stop the watcher, and release this rank's lock (``orderly``: saying first that this rank destroyed its
        Buffer, and ``how``: :data:`CLOSED`, :data:`CLOSED_FAILED` or :data:`CLOSED_BROKEN`, so its peers do not take it
        for dead and know whether it told them of an error first). Idempotent."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join()
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                if orderly:
                    os.pwrite(fd, bytes([_BYTES[how]]), self.rank)
            finally:
                os.close(fd)
        _open.discard(self)

    def _forked(self) -> None:
        """In a child forked from this process: drop this descriptor (the parent keeps the lock) and the watcher
        (threads do not survive a fork)."""
        self._thread = None
        drop_descriptor(self)
