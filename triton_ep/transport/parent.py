"""How a helper process sees that the process it works for is gone, SIGKILL included, and ends with it: the RDMA
proxy process (:func:`triton_ep.proxy_process.proxy_side.serve` watches its rank) and the rank processes of
:func:`triton_ep.testing.run_ranks` (``triton-ep tune``'s ranks: :func:`exit_with_parent`, which the test kit
reaches through :mod:`triton_ep.runtime`).

The parent is watched through a pidfd of it (``os.pidfd_open``, Linux 5.3 and later: readable once the parent has
ended) and ``os.getppid()``, which changes when the parent dies and the process is re-parented (the only sign where
no pidfd can be opened); both are looked at every :data:`PARENT_POLL_S`. Not through a pipe or socket to the parent:
processes forked from the watched one keep such descriptors open. Imported in the proxy process, which has neither
torch nor Triton (:mod:`triton_ep.proxy_main`): this module imports neither.
"""
from __future__ import annotations

import os
import select
import threading
from dataclasses import dataclass
from typing import Collection, List, Optional

#: seconds between looks at the parent: a process whose parent died ends within about this long
PARENT_POLL_S = 0.1
#: the exit status of a process that ended because its parent was gone (:func:`exit_with_parent`; the proxy
#: process's :func:`triton_ep.proxy_process.proxy_side.serve` returns it too)
PARENT_GONE_STATUS = 4


@dataclass
class ParentWatch:
    """The parent ``ppid`` as watched: ``pidfd`` is a pidfd of it (``None`` where the system gives none; then
    ``getppid()`` alone tells). Made by :meth:`of`; :meth:`close` closes the pidfd."""
    ppid: int
    pidfd: Optional[int]

    @classmethod
    def of(cls, ppid: Optional[int] = None) -> "ParentWatch":
        """Watch ``ppid`` (default: this process's parent now). A parent already gone is seen by :meth:`gone`
        (``getppid()`` differs), whether or not its pidfd could be opened."""
        ppid = os.getppid() if ppid is None else ppid
        try:
            pidfd: Optional[int] = os.pidfd_open(ppid)
        except (AttributeError, OSError):     # (an old kernel or Python; the parent already reaped: ESRCH)
            pidfd = None
        return cls(ppid, pidfd)

    def fds(self) -> List[int]:
        """The descriptors to ``select`` for readability beside one's own (the pidfd, if any)."""
        return [] if self.pidfd is None else [self.pidfd]

    def gone(self, readable: Collection[int] = ()) -> bool:
        """Whether the parent has ended: its pidfd is among ``readable`` (what ``select`` returned), or this
        process has another parent now."""
        return (self.pidfd is not None and self.pidfd in readable) or os.getppid() != self.ppid

    def close(self) -> None:
        """Close the pidfd (idempotent)."""
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def exit_with_parent(ppid: Optional[int], status: int = PARENT_GONE_STATUS,
                     poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Start a daemon thread that ends this process with ``os._exit(status)`` once its parent ``ppid`` is gone,
    within about ``poll_s`` seconds. ``ppid`` is the parent's pid as the parent knew it when it started this process
    (``os.getpid()`` there): a parent that died before this call (a process may spend seconds importing torch
    first) is then seen at once, where ``getppid()`` asked here would name the process that adopted this one.
    ``None``: the parent as it is now. For a process whose main thread may sit in a long wait when its parent dies
    (a rank of a collective whose peers stop answering; a signal is handled only between bytecodes): no
    ``finally`` or ``atexit`` runs, so what it holds must not need them (triton-ep's ``/dev/shm`` files are
    unlinked once mapped, and an RDMA proxy process watches this process in turn).

    Returns:
        The thread (named ``triton_ep-parent-watch``); it runs as long as the process.
    """
    watch = ParentWatch.of(ppid)

    def run() -> None:
        while True:
            readable, _, _ = select.select(watch.fds(), [], [], poll_s)
            if watch.gone(readable):
                os._exit(status)

    t = threading.Thread(target=run, name="triton_ep-parent-watch", daemon=True)
    t.start()
    return t


__all__ = ["PARENT_GONE_STATUS", "PARENT_POLL_S", "ParentWatch", "exit_with_parent"]
