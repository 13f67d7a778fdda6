"""The rank's side of a proxy process: :class:`ProcessScheduler` (the scheduler's host API over rings shared with
the proxy process, which owns the transport), :func:`bootstrap_process`, and :func:`proxy_kind` (where a Buffer's
proxy runs)."""
from __future__ import annotations

import atexit
import mmap
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Dict, Optional, Sequence

import numpy as np

from triton_ep.errors import EPError
from triton_ep.protocol import signal_header as F
from triton_ep.scheduler import (STAGE_INTERNAL, STAGE_NAMES, PeerGoneError, ProxyError, ProxyRemoteError, RingLayout,
                                 Scheduler, fault_word, parse_fault, placed_error)
from triton_ep.scheduler.faults import fails_at_once
from triton_ep.transport import shm
from triton_ep.transport.rdma import QP_INFO_STAGE, exchange_info, exchange_regions
from triton_ep.transport.ring_flags import RingFlags

from .channel import pack_error, recv_msg, send_msg, start_proxy, unpack_error
from .heartbeat import LOOK_S, Heartbeat
from .notices import FaultNotices

#: the environment variable that picks where a Buffer's RDMA proxy runs: ``process`` (the default on Linux) or
#: ``thread``
ENV_PROXY = "TRITON_EP_PROXY"
PROXY_KINDS = ("thread", "process")
#: where the proxy runs when ``TRITON_EP_PROXY`` is unset or empty: a process of its own on Linux (its rings are
#: /dev/shm files, its parent watched by pidfd), a thread elsewhere
DEFAULT_PROXY = "process" if sys.platform.startswith("linux") else "thread"
#: seconds :meth:`ProcessScheduler.check` waits for the proxy's error once the abort word says it failed
ERROR_WAIT_S = 2.0
#: the stage a dead proxy process is reported at
STAGE_PROCESS = f"{STAGE_NAMES[STAGE_INTERNAL]}/process"


def proxy_kind(value: Optional[str] = None) -> str:
    """Where the RDMA proxy runs: ``value``, else ``$TRITON_EP_PROXY`` (unset or empty: :data:`DEFAULT_PROXY`,
    ``"process"`` on Linux).

    Raises:
        ValueError: another value (it names the variable and the choices).
    """
    v = os.environ.get(ENV_PROXY, "") if value is None else value
    v = v.strip().lower() or DEFAULT_PROXY
    if v not in PROXY_KINDS:
        raise ValueError(f"{ENV_PROXY}={v!r}: the RDMA proxy runs as a 'thread' of the rank's process or as a "
                         f"'process' of its own")
    return v


class ProcessScheduler(Scheduler):
    """The rank's side of a proxy process: the same host API as :class:`~triton_ep.scheduler.Scheduler` (rings,
    producer and consumer calls, host waits, :meth:`check`, :meth:`fail`, :meth:`rebase`, :meth:`stats`,
    :meth:`close`) over rings shared with the proxy process, which owns the transport. Built and connected by
    :func:`bootstrap_process`.

    Args:
        backend: ``"verbs"`` or ``"emulated"`` (:func:`triton_ep.transport.factory.open_transport`).
        rank, world: this rank and the ranks of the RDMA group.
        transport_kw: the other arguments of ``open_transport`` (picklable: the emulated fabric pickles as its
            spec and token).
        slots, slot_bytes, timeout_s, arrival_words and the other ``sched_kw``: the proxy's
            :class:`~triton_ep.scheduler.Scheduler` arguments (``memory``, ``on_signal`` and ``trace`` have no
            meaning across processes: ``ValueError``).
        device: the kernels' device: on CUDA the mapping is registered with ``cudaHostRegister`` (device-mapped).
    Raises:
        ValueError: bad sizes, or an argument that cannot cross to the proxy. OSError: /dev/shm has no room for
        the rings (it names the size and ``--shm-size`` / ``--ipc=host``). ProxyError: the proxy process did not
        start or its transport failed to open (its error).
    """

    def __init__(self, backend: str, rank: int, world: int, transport_kw: dict, *, slots: int = 8,
                 slot_bytes: int = 1 << 20, timeout_s: float = 100.0, device=None, peers: Optional[Sequence[int]] = None,
                 **sched_kw) -> None:
        bad = [k for k in ("memory", "on_signal", "trace") if sched_kw.get(k)]
        if bad:
            raise ValueError(f"{', '.join(bad)}: not available with the proxy in a process of its own ({ENV_PROXY})")
        if slots < 1 or slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"slots must be >= 1 and slot_bytes a positive multiple of 64 (got {slots}, {slot_bytes})")
        self.rank, self.world = int(rank), int(world)
        self.layout = RingLayout(self.world, slots, slot_bytes)
        self.slots, self.slot_bytes, self.timeout_s = slots, slot_bytes, float(timeout_s)
        self.arrival_words = bool(sched_kw.get("arrival_words", False))
        self.trace, self.on_signal, self.events = False, None, []
        self.waiting: Optional[str] = None
        self.on_gone = None
        self.peers = sorted(int(p) for p in peers) if peers is not None else [p for p in range(world) if p != rank]
        self._next_tx = {p: 0 for p in self.peers}
        self._next_rx = {p: 0 for p in self.peers}
        self.error: Optional[BaseException] = None
        self._pid = os.getpid()
        self._err_lock, self._req_lock = threading.Lock(), threading.Lock()
        self._replies: "queue.Queue" = queue.Queue()
        self._closing = self._closed = False
        #: the proxy process stopped making progress (:meth:`_look_at_beat`): it answers no command any more
        self._stalled = False
        self._cuda_ptr = None
        self.proc = self._sock = self._listener = None
        self._bell: Optional[int] = None
        #: where a dead proxy's fault goes to the peers and theirs come from (set by :func:`bootstrap_process`)
        self.notices: Optional[FaultNotices] = None
        n = self.layout.nbytes
        path = shm.create_file(shm.shm_name(f"proxy.{os.getpid()}.r{rank}.{uuid.uuid4().hex[:8]}"), n)
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, n)
            finally:
                os.close(fd)
            self.mem = np.frombuffer(self._map, np.uint8)
            self.flags = RingFlags(self.mem[:self.layout.ctrl_bytes].view(np.int64), self.rank, self.world, slots)
            if device is not None and getattr(device, "type", device) == "cuda":
                self._register_cuda()
            self._spawn()
            self.local_infos = self._request("setup", dict(path=path, nbytes=n, backend=backend, rank=self.rank,
                                                           world=self.world, transport_kw=transport_kw,
                                                           sched_kw=dict(slots=slots, slot_bytes=slot_bytes,
                                                                         timeout_s=timeout_s, **sched_kw)))
        except BaseException:
            self.close()
            raise
        finally:
            os.unlink(path)     # both processes mapped it (or it failed): its name goes now
        atexit.register(_close_at_exit, weakref.ref(self))

    def _register_cuda(self) -> None:
        """Pin the mapping and map it into the device's address space (``cudaHostRegister`` with
        ``cudaHostRegisterPortable | cudaHostRegisterMapped``): kernels take it as they take pinned memory."""
        import torch
        ptr = self.mem.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.mem.nbytes, 3)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"rank {self.rank}: cudaHostRegister of the RDMA proxy's rings ({self.mem.nbytes} "
                               f"bytes) failed: {err}")
        self._cuda_ptr = ptr

    def _spawn(self) -> None:
        """Start the proxy process and the thread that reads its channel."""
        started = start_proxy()
        self.proc, self._sock, self._bell = started.proc, started.sock, started.bell
        self._listener = threading.Thread(target=self._listen, name=f"triton-ep-proxy-channel-{self.rank}",
                                          daemon=True)
        self._listener.start()

    def _listen(self) -> None:
        """Read the channel: replies go to the requester, the proxy's error is recorded; at the channel's end (the
        proxy process ended) a :class:`ProxyError` is recorded unless this side closed it. While the channel is
        quiet, look at the proxy's heartbeat every :data:`~.heartbeat.LOOK_S` (:meth:`_look_at_beat`)."""
        beat = Heartbeat(self.timeout_s)
        while True:
            try:
                if not select.select([self._sock], [], [], LOOK_S)[0]:
                    self._look_at_beat(beat)
                    continue
                msg = recv_msg(self._sock)
            except (OSError, ValueError):       # (ValueError: the socket was closed under select)
                msg = None
            if msg is None:
                break
            if msg[0] == "error":
                self._record(unpack_error(msg[1]))
            else:
                self._replies.put(msg)
        if not (self._closing or self._closed):     # (closed: this side asked it to end)
            try:
                code = self.proc.wait(timeout=1.0)
                how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            except subprocess.TimeoutExpired:
                how = "closed its channel"
            ex = ProxyError(self.rank, None, None, None, STAGE_PROCESS,
                            f"the RDMA proxy process (pid {self.proc.pid}) ended: {how}")
            # (the dead proxy cannot write its fault word into the peers' rings: this process tells them)
            self._record(ex, notice=f"ended (pid {self.proc.pid}, {how})")
        self._replies.put(None)

    def _look_at_beat(self, beat: Heartbeat) -> None:
        """Where the proxy process lives but stopped making progress (:meth:`Heartbeat.stalled
        <triton_ep.proxy_process.heartbeat.Heartbeat.stalled>`: its heartbeat word stood still, each sweep stores its
        clock there) while no error is recorded and this side is not closing: record a :class:`ProxyError` naming
        this rank's proxy process (every ring wait ends: the abort word) and tell the peers through the group's
        store (:class:`FaultNotices`), as for a dead proxy: a stopped one writes no fault word either. Its commands
        go unanswered from then on (:meth:`_request` raises; :meth:`close` kills it)."""
        if self.error is not None or self._closing or self._closed:
            return
        now = time.monotonic()
        why = beat.stalled(self.flags.beat(), now, self.proc.pid)
        if why is None:
            return
        pid, still = self.proc.pid, beat.still_s(now)
        ex = ProxyError(self.rank, None, None, None, STAGE_PROCESS,
                        f"the RDMA proxy process (pid {pid}) stopped making progress: {why}; its sweeps have not "
                        f"run for {still:.1f} s; this call's outputs here are not valid; destroy() and rebuild the "
                        f"Buffer")
        if self._record(ex, notice=f"stopped making progress (pid {pid}, {why}, no sweep for {still:.1f} s)"):
            self._stalled = True

    def _peer_fault(self, peer: int, word: int, why: str) -> None:
        """``peer``'s proxy process died or stopped and its rank said so (:class:`FaultNotices`): fail as its fault
        word in the ring would have made this rank's proxy fail (``ProxyRemoteError`` naming the peer; a masked peer
        is ignored). ``why``: what its rank saw, e.g. "ended (pid 12, killed by signal 9)" or "stopped making
        progress (...)"."""
        if self.flags.masked(peer):
            return
        st, ch, q = parse_fault(word)
        self.fail(ProxyRemoteError(self.rank, peer, ch, q, STAGE_NAMES.get(st, STAGE_NAMES[STAGE_INTERNAL]),
                                   f"the peer's RDMA proxy process {why}; its rank told its peers "
                                   f"through the group's store"))       # (the peer's number: the error's field,
        # which the mode renames to a global rank; a number in the text would stay the network leg's)

    def _record(self, ex: BaseException, notice: Optional[str] = None) -> bool:
        """Record ``ex`` as the error (the first one wins) and end every ring wait. Returns whether it was the
        first. ``notice``: this rank's proxy process died or stopped (it writes no fault word), because ``notice``:
        where ``ex`` is the first error, tell the peers through the group's store (:meth:`FaultNotices.post`)
        before the ring waits end. This rank's kernels, whose waits the abort word ends, then write their failure
        words into its host mates' control blocks after the notice is in the store: a host mate whose wait such a
        word ended finds the notice there (:meth:`FaultNotices.look`) and names this rank's proxy, not a plain
        failure of this rank."""
        with self._err_lock:
            first = self.error is None
            if first:
                self.error = ex
        if first and notice is not None and self.notices is not None:
            self.notices.post(fault_word(STAGE_INTERNAL, None, None), notice)
        self.flags.abort(2)
        if first and isinstance(ex, PeerGoneError) and self.on_gone is not None:
            self.on_gone(ex.peer)
        return first

    def _request(self, cmd: str, *args, timeout_s: Optional[float] = None) -> Any:
        """Send ``cmd`` to the proxy process and wait for its answer (bounded: ``timeout_s``, default the
        scheduler's bound + 10 s; it ends once the proxy is found stopped, :meth:`_look_at_beat`). Raises the proxy's
        error for the command, or ProxyError (the stopped proxy's among them)."""
        if os.getpid() != self._pid:
            raise ProxyError(self.rank, None, None, None, STAGE_PROCESS,
                             "a process forked from the rank cannot drive the rank's RDMA proxy")
        wait = self.timeout_s + 10.0 if timeout_s is None else timeout_s
        with self._req_lock:
            if self._stalled:
                raise self.error
            try:
                send_msg(self._sock, (cmd,) + args)
            except OSError as ex:
                raise self.error or ProxyError(self.rank, None, None, None, STAGE_PROCESS,
                                               f"the RDMA proxy process is gone ({ex})") from None
            deadline = time.monotonic() + wait
            while True:
                try:
                    msg = self._replies.get(timeout=max(0.0, min(LOOK_S, deadline - time.monotonic())))
                    break
                except queue.Empty:
                    if self._stalled:       # (its answer, should it come, is read by nobody: no command follows)
                        raise self.error from None
                    if time.monotonic() >= deadline:
                        raise ProxyError(self.rank, None, None, None, STAGE_PROCESS,
                                         f"the RDMA proxy process did not answer {cmd!r} within {wait:g} s") from None
        if msg is None:
            self._replies.put(None)     # (the next requester sees the end too)
            raise self.error or ProxyError(self.rank, None, None, None, STAGE_PROCESS, "the RDMA proxy process ended")
        kind, val = msg
        if kind == "err":
            raise unpack_error(val)
        return val

    # ---------------------------------------------------------------- Scheduler's API, across the channel
    def start(self, remotes) -> "ProcessScheduler":       # noqa: D102  (the set-up goes by bootstrap_process)
        raise TypeError("a ProcessScheduler is started by bootstrap_process")

    def remote_region(self):
        """Not available here: the proxy process's region travels in :func:`bootstrap_process`."""
        raise TypeError("a ProcessScheduler's region is exchanged by bootstrap_process")

    def ring(self) -> None:
        """Ring the proxy's doorbell: an idle proxy process's sweeps wake at once and poll without napping for a
        while (:class:`~triton_ep.proxy_process.ProxySweeps`). About a microsecond (one ``write`` to an eventfd);
        a no-op once closed."""
        if self._bell is not None:
            try:
                os.eventfd_write(self._bell, 1)
            except OSError:     # (its counter is full: the proxy is awake already)
                pass

    def publish(self, peer: int, seq: int, nbytes: int) -> None:
        """:meth:`HostRings.publish <triton_ep.scheduler.rings.HostRings.publish>`, then :meth:`ring`."""
        super().publish(peer, seq, nbytes)
        self.ring()

    def check(self) -> None:
        """Ring the doorbell (:meth:`ring`: the network leg calls this at each call's start), then raise the proxy's
        error: its own (sent over the channel), the end of its process, or its stop (:meth:`_look_at_beat`). Where
        the rings say the proxy failed (:meth:`_proxy_failing`) but its error is still on its way over the channel,
        wait for it (up to :data:`ERROR_WAIT_S`), so the rank raises the proxy's own error as with a proxy thread."""
        self.ring()
        if self.error is None and not self._closed and self._proxy_failing():
            deadline = time.monotonic() + ERROR_WAIT_S
            while self.error is None and time.monotonic() < deadline:
                time.sleep(0.001)
        if self.error is not None:
            self.error = placed_error(self.error, self.wait_stage())
            raise self.error

    def _proxy_failing(self) -> bool:
        """Whether the rings say that the proxy failed or is about to (its error may still be on the channel): the
        abort word says so (2), a ring kernel recorded a wait that a failure ended, or a peer's fault word landed
        (the proxy raises ``ProxyRemoteError`` at its next sweep; a kernel may see the word first)."""
        f = self.flags
        if f.aborted == 2:
            return True
        rec = f.record()
        if rec is not None and rec.kind != int(F.E_TIMEOUT):
            return True
        R = self.world
        return any(w and fails_at_once(w)     # (a clean close, or a close after one, fails nothing yet)
                   for w in f.rows()[(RingFlags.FAULT - RingFlags.READY) * R:])

    def fail(self, ex: BaseException) -> None:
        """Record ``ex`` (the first error wins), end every ring wait, and have the proxy stop and tell the peers
        (their ``FAULT`` words), as :meth:`Scheduler.fail` does in its process."""
        if not isinstance(ex, EPError):
            ex = ProxyError(self.rank, getattr(ex, "peer", None), None, None, STAGE_NAMES[STAGE_INTERNAL],
                            f"{type(ex).__name__}: {ex}")
        if self._record(ex) and self._sock is not None and not self._closed:
            try:
                self._request("fail", pack_error(ex), timeout_s=5.0)
            except Exception:   # noqa: BLE001  (best effort: a dead proxy tells nobody)
                pass

    def wait_quiet(self, peer: int, stage: str) -> None:
        """:meth:`Scheduler.wait_quiet`, in the proxy process."""
        self._request("wait_quiet", int(peer), stage)

    def rebase(self, peer: int, tx: int, rx: int) -> None:
        """:meth:`Scheduler.rebase`, in the proxy process (and this side's next chunk numbers)."""
        self._request("rebase", int(peer), int(tx), int(rx))
        self._next_tx[peer], self._next_rx[peer] = int(tx), int(rx)

    def test_hook(self, name: str, *args) -> None:
        """Run a test hook of :mod:`triton_ep.testing` in the proxy process, where the transport and the sweeps
        are: ``"break_qp", peer, qp`` (the QP goes to the error state), ``"drop_signal", peer, seq`` (chunk
        ``seq``'s signal to ``peer`` is left out)."""
        self._request(f"hook_{name}", *args)

    def stats(self) -> dict:
        """:meth:`Scheduler.stats` of the proxy process's scheduler, with ``proxy_process_cpu_s``: the whole proxy
        process's CPU seconds (every thread, idle polling included)."""
        return self._request("stats")

    def close(self) -> None:
        """End the proxy process (its transport closed) and reap it; idempotent. In a process forked from the
        rank's (it inherited this object) nothing happens: the proxy is the rank's."""
        if os.getpid() != self._pid or self._closed:
            return
        self._closed = True
        if self.notices is not None:
            self.notices.close()
        if self.proc is not None and self.proc.poll() is None:
            if self._stalled:   # (stopped: it would not answer; SIGKILL ends a stopped process too)
                self.proc.kill()
            else:
                try:        # (after a failure too: the proxy still answers, its sweeps stopped)
                    self._request("close", timeout_s=5.0 if self.error is not None else self.timeout_s + 10.0)
                except Exception:   # noqa: BLE001  (it is ended below either way)
                    pass
        self._closing = True
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._listener is not None:
            self._listener.join(timeout=5.0)
        if self._sock is not None:
            self._sock.close()
        if self._bell is not None:
            bell, self._bell = self._bell, None
            os.close(bell)
        if self._cuda_ptr is not None:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self._cuda_ptr)
            self._cuda_ptr = None
        self._unmap()

    def _unmap(self) -> None:
        """Unmap the rings and close the mapping's descriptor (``mmap`` keeps a duplicate of it) now, not when the
        garbage collector finds this object: the control words live on in a private copy (read after the close,
        e.g. a fault word), the views of the region are dropped. The rank's own views of the rings (the network
        leg's tensors) must be gone by then (``Network.close`` drops them first); if one is still alive the mapping
        stays until it goes (``BufferError``: never unmapped under a live view)."""
        if getattr(self, "_map", None) is None:
            return
        flags = getattr(self, "flags", None)
        if flags is not None:
            self.flags = RingFlags(flags.w.copy(), self.rank, self.world, self.slots)
        self.mem = flags = None
        try:
            self._map.close()
        except BufferError:         # a view of the rings is still alive: the mapping goes with it
            return
        self._map = None


def _close_at_exit(ref) -> None:
    s = ref()
    if s is not None:
        s.close()


def bootstrap_process(backend: str, rank: int, world: int, transport_kw: dict, sched_kwargs: dict, group=None,
                      device=None) -> ProcessScheduler:
    """:func:`triton_ep.scheduler.bootstrap` with the proxy in a process of its own: start it (it opens the
    transport), exchange QP infos through the group's store, connect, exchange regions, start the sweeps.
    Collective over ``group``. Returns the started :class:`ProcessScheduler`; on any failure nothing is left
    (the proxy process ended and reaped, no file). A rank whose proxy cannot start (no room in /dev/shm for its
    rings, no process) raises that error and its peers raise ``EPRemoteError`` quoting it at once, not at
    ``timeout_s`` (the QP-info exchange carries it)."""
    import torch.distributed as dist
    from triton_ep.transport.bootstrap import Exchange, _group_store     # (torch: not in the proxy process)
    group = group if group is not None else dist.group.WORLD
    name = str(getattr(group, "group_name", ""))
    n = _legs[name] = _legs.get(name, 0) + 1      # (every rank opens its legs in the same order: the same n)
    kw = dict(sched_kwargs)
    peers = transport_kw.get("peers")
    infos = Exchange(group, kw.get("timeout_s", 100.0), QP_INFO_STAGE)
    try:
        ps = ProcessScheduler(backend, rank, world, transport_kw, device=device, peers=peers, **kw)
    except BaseException as ex:
        infos.fail(f"could not start its RDMA proxy process ({ENV_PROXY}=process): {type(ex).__name__}: {ex}")
        raise
    try:
        remote = exchange_info(ps.local_infos, group, ps.timeout_s, exchange=infos)
        region = ps._request("connect", {p: remote[p] for p in ps.peers})
        ps._request("start", exchange_regions(region, group, ps.timeout_s))
        store = _group_store(group)
        if store is not None:       # (every rank of the leg: in low-latency mode a host mate has no QP to this rank,
            # but its calls need this rank's as much; with its RDMA peers' errors it would name them, not the root cause)
            ps.notices = FaultNotices(store, f"triton_ep/proxyfault/{name}/{n}/", ps.rank,
                                      [p for p in range(ps.world) if p != ps.rank], ps._peer_fault)
    except BaseException:
        ps.close()
        raise
    return ps


#: network legs with a proxy process opened per group (by group name), this process: the fault notices' keys
_legs: Dict[str, int] = {}
