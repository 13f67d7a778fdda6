"""The RDMA proxy as a process of its own (``TRITON_EP_PROXY=process``; Linux): the scheduler's sweeps beside the
model instead of under its GIL.

The rank's process keeps the producer and consumer side of the rings (kernels, host code): the rings are a file
in /dev/shm mapped by both processes (reserved up front with ``posix_fallocate``; on GPU the rank registers the
mapping with CUDA, device-mapped). The proxy process owns the transport (pyverbs context, PD, CQs, QPs, MRs, or
the emulated NIC) and runs :class:`~triton_ep.scheduler.Scheduler`'s proxy threads on the same rings. The two talk
through the rings' words (every chunk) and a small command channel (a socket pair: set-up, renumbering, failure,
statistics, close; never per chunk).

- Start-up: a fresh interpreter through ``subprocess.Popen`` (descriptors closed but its end of the channel, its
  own session, SIGINT ignored) running :mod:`triton_ep.proxy_main`, which imports neither torch nor
  Triton; nothing is forked from the rank's process, the user's ``__main__`` is never run again.
- Lifetime: :meth:`ProcessScheduler.close` ends and reaps it; the rank's process ending (SIGKILL included) ends
  it within a second (it watches its parent through a pidfd, and ``getppid()``, :mod:`triton_ep.transport.parent`:
  not through the channel, which processes forked from the rank keep open); a process forked from the rank that
  inherited the scheduler never closes it (the pid is checked). The rings' file is unlinked once both processes
  mapped it, and the emulated fabric's ring files once every QP is connected: nothing stays in /dev/shm on any
  path.
- Failure: a proxy that fails records its :class:`~triton_ep.scheduler.ProxyError` as today (abort word, fault
  words to the peers) and sends it over the channel; a proxy process that dies is a ``ProxyError`` naming the
  rank, its pid and how it ended, at the rank's next :meth:`~ProcessScheduler.check` (a thread of the rank's
  process reads the channel: its end is seen at once) and every ring wait ends (the abort word). A dead proxy
  writes no fault word: the rank's process posts it in the group's store for it (:class:`FaultNotices`), and
  the peers fail as its fault word would have made them. A proxy process that lives but stopped making progress
  (SIGSTOP, a debugger, starved of CPU) is a ``ProxyError`` naming the rank and its pid, the same way: each sweep
  stores its clock into the rings' heartbeat word, which the same thread of the rank's process looks at
  (:class:`~.heartbeat.Heartbeat`: 1 s still while stopped, half ``timeout_s`` in any other state); its notice
  goes to the peers, and ``close`` kills it.
- Idle: the sweeps back off from a yield to naps of up to :data:`IDLE_MAX_S` (:class:`ProxySweeps`).

Its modules: :mod:`.rank_side` (:class:`ProcessScheduler`, :func:`bootstrap_process`, :func:`proxy_kind`),
:mod:`.proxy_side` (:func:`serve`, :class:`ProxySweeps`: what runs in the proxy process), :mod:`.channel` (the
command channel's messages, errors across it, :func:`start_proxy`), :mod:`.notices` (:class:`FaultNotices`) and
:mod:`.heartbeat` (:class:`~.heartbeat.Heartbeat`: a proxy that stopped making progress).
"""
from __future__ import annotations

from .channel import pack_error, start_proxy, unpack_error
from .notices import FaultNotices
from .proxy_side import ProxySweeps, serve
from .rank_side import ENV_PROXY, PROXY_KINDS, ProcessScheduler, bootstrap_process, proxy_kind

__all__ = ["ProcessScheduler", "ProxySweeps", "FaultNotices", "bootstrap_process", "proxy_kind", "ENV_PROXY", "PROXY_KINDS", "serve",
           "pack_error", "unpack_error", "start_proxy"]
