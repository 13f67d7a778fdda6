"""Which ranks of one host still live: a lock each rank holds for its Buffer's lifetime, which the kernel
releases when the process ends, however it ends (SIGKILL included).

At set-up (:func:`triton_ep.transport.ipc.open_group`) the first rank makes a small *liveness file* next to
the shared buffers, every rank opens it and takes an open-file-description lock (Linux ``F_OFD_SETLK``) on
its own byte of it; the file's name is unlinked once every rank has it open, so nothing stays in
``/dev/shm`` even when a process is killed. A peer whose byte is no longer locked (``F_OFD_GETLK``: a query
that takes nothing) has either destroyed its Buffer, which first writes 1 into its byte, or its process is
gone. Locks are on the file, not on process ids: PID namespaces (containers sharing ``/dev/shm``) do not
matter. A process that forks after the set-up (a data loader's workers) closes its copy of the descriptor in
the child, so a child never keeps a dead parent's lock alive.

:meth:`Liveness.watch` starts the watcher: one daemon thread per Buffer that polls the peers' locks every
:data:`POLL_S` seconds (``R - 1`` ``fcntl`` calls, a few microseconds) and reports each peer found dead once;
the Runtime turns that into the ``DEAD`` words the kernels' waits read (:mod:`triton_ep.kernels.flags`).
Host waits ask :meth:`Liveness.dead_peers` themselves. Where ``F_OFD_GETLK`` does not exist (not Linux),
:func:`supported` is False and dead peers are seen at ``timeout_s`` as before.
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
#: a byte's content: 1 once its rank destroyed its Buffer (released its lock on purpose)
_CLOSED = b"\x01"

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
        #: peers found dead so far (sticky)
        self.dead: Dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        _open.add(self)

    @staticmethod
    def _held(fd: int, peer: int) -> bool:
        """Whether ``peer``'s byte is locked (by its process: this rank's own descriptor holds only its byte)."""
        return byte_locked(fd, peer)

    def dead_peers(self, peers: Optional[Iterable[int]] = None) -> Dict[int, str]:
        """``{peer: "dead"}`` of the peers (default: all) whose process is gone, looked at now (a peer that
        destroyed its Buffer is not dead). Empty once closed."""
        fd = self.fd
        if fd is None:
            return {}
        for p in range(self.size) if peers is None else peers:
            if p != self.rank and p not in self.dead and not self._held(fd, p) and os.pread(fd, 1, p) != _CLOSED:
                self.dead[p] = "dead"
        return {p: w for p, w in self.dead.items() if peers is None or p in peers}

    def watch(self, on_dead: Callable[[int], None], poll_s: float = POLL_S) -> None:
        """Start the watcher thread: every ``poll_s`` seconds it looks at every peer's lock and calls
        ``on_dead(peer)`` once for each peer found dead (from that thread; ``on_dead`` must not raise, and
        should hold no reference to what owns this object). It stops at :meth:`close`."""
        if self._thread is not None or self.size < 2:
            return
        stop, told = self._stop, set()

        def run() -> None:
            while not stop.wait(poll_s):
                try:
                    dead = self.dead_peers()
                except OSError:         # closed under us (close() races the look): stop
                    return
                for p in dead:
                    if p not in told:
                        told.add(p)
                        on_dead(p)

        self._thread = threading.Thread(target=run, name=f"triton-ep-liveness-r{self.rank}", daemon=True)
        self._thread.start()

    def close(self, orderly: bool = True) -> None:
        """Stop the watcher, and release this rank's lock (``orderly``: saying first that this rank destroyed its
        Buffer, so its peers do not take it for dead). Idempotent."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join()
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                if orderly:
                    os.pwrite(fd, _CLOSED, self.rank)
            finally:
                os.close(fd)
        _open.discard(self)

    def _forked(self) -> None:
        """In a child forked from this process: drop this descriptor (the parent keeps the lock) and the watcher
        (threads do not survive a fork)."""
        self._thread = None
        drop_descriptor(self)
