"""What every mode of one Buffer shares: the group's shared buffers and signals, stream order, error checks,
call cards and the driver of a collective's steps.

A mode (:mod:`triton_ep.modes`) gets one :class:`Runtime` and uses only its public members. The body of
every collective call is a generator that yields at each phase boundary: :meth:`Runtime.run` drives it for
a real rank, meeting the other ranks on the host only at :class:`Meet` steps (the re-synchronisation after
an error), while the kernels wait for each other on the device; :mod:`triton_ep.testing` drives the same
generators for ranks simulated in one process.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
import weakref
import uuid
from typing import Callable, Generator, Optional, Sequence

import torch
import torch.distributed as dist

from ..kernels._util import interpreted, num_sms
from ..config import EventOverlap
from ..errors import EPError, EPRemoteError, EPTimeoutError
from ..kernels import flags as F
from ..protocol import call_card as card
from ..transport import ipc, signals, verbs
from ..transport.bootstrap import Exchange
from ..transport.liveness import dead_error
from .hosts import (ENV_RANKS_PER_HOST, Hosts, agreed, choose_transport, group_hosts, host_identity,
                    rdma_backend_arg)
from .checks import (DEFAULT_TIMEOUT_S, Rejected, bytes_arg, check_num_experts, check_tensor, device_arg,
                     raise_rejected, timeout_arg)

Tensor = torch.Tensor
_NO_CTX = contextlib.nullcontext()        # reusable: entering it does nothing
# Exchange-slot header words (int64), ipc.SLOT_HEADER of them.
_BASE, _HASERR, _SEQ, _XN = 12, 13, 14, 15   # rounds completed, holds an error, dispatches, exchange number


class Meet(str):
    """A step where the ranks meet on the host (a bounded barrier in the control block): the
    re-synchronisation after an error. Every other step a call yields is only a phase boundary: ranks
    simulated in one process run their launches phase by phase, and real ranks wait for each other on the
    device."""


def collective(e: BaseException) -> BaseException:
    """Mark ``e`` as raised on every rank at the same step (the group stays in step)."""
    e._ep_collective = True
    return e


def steps(fn: Callable) -> Callable:
    """Decorate a mode's step generator (a method of an object with a ``rt`` :class:`Runtime`): whatever
    it raises, this rank first tells its peers (a failure word in their signal headers), so kernels of
    theirs that wait for this rank's part of the call stop at once and raise ``EPRemoteError``; the next
    call re-synchronises the group. Every call it starts counts as one (:meth:`Runtime.count_call`), also on
    a rank that rejects its arguments before publishing its card, so the ranks' call numbers stay equal."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        self.rt.count_call()
        try:
            return (yield from fn(self, *args, **kwargs))
        except GeneratorExit:
            raise
        except BaseException as e:
            self.rt.tell_failure(e)
            raise
    return run


class Runtime:
    """One rank's shared machinery for one Buffer.

    Args:
        comm: the group's shared buffers (:class:`triton_ep.transport.ipc.Comm`).
        timeout_s: bound on every wait for a peer, in seconds.
        uid: the Buffer's unique id (handles name it).
        group: the process group, ``None`` for ranks simulated in one process.
        hosts: which ranks share a host (:class:`~triton_ep.runtime.hosts.Hosts`; default: one host).
        rdma_transport: the transport between hosts, ``None`` for one host, ``"emulated"`` or ``"verbs"``.

    Attributes:
        comm, sig (:class:`~triton_ep.transport.signals.Signals`), sig_args (what signalling kernels take),
        rank, group_size, device, timeout_s, uid, group, delta_words (int64 ``[R]``: peer buffers minus this
        one, in 32-bit words), comm_stream (``None`` on CPU), dispatch_seq (dispatches so far, the same on
        every rank: names handles), host_waits (``{"meet": n, "poll": n}``: host rendezvous and count polls
        so far, read by :func:`triton_ep.testing.host_waits`), hosts, num_hosts, rdma_transport.
    """

    def __init__(self, comm: ipc.Comm, timeout_s: float, uid: str, group=None, ll_offset: int = 0,
                 ll_bytes: int = 0, hosts: Optional[Hosts] = None, rdma_transport: Optional[str] = None) -> None:
        self.comm, self.timeout_s, self.uid, self.group = comm, float(timeout_s), uid, group
        self.hosts = hosts if hosts is not None else Hosts((0,) * comm.size, ("this host",), "one process")
        self.num_hosts, self.rdma_transport = self.hosts.num_hosts, rdma_transport
        #: where the low-latency area starts in the data buffer, and its bytes (0: none)
        self.ll_offset, self.ll_bytes = int(ll_offset), int(ll_bytes)
        self.rank, self.group_size, self.device = comm.rank, comm.size, comm.device
        with torch.inference_mode(False):
            self.delta_words = comm.delta_bytes // 4
        self.sig = signals.Signals(comm.rank, comm.size, comm.header, comm.peer_headers, comm.delta_bytes,
                                   comm.device, self.timeout_s, interpreted=interpreted())
        self.sig_args = self.sig.kernel_args(comm.max_programs)
        self.sig_args["sms"] = num_sms(comm.device)      # (the normal-mode launches' grid cap, kernels.dispatch._grid)
        # (split send / receive launches skip their end-of-launch counts where ranks run concurrently:
        # kernels.dispatch._defer)
        self.sig_args["defer"] = comm.concurrent
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        #: the running call's kernels go to the communication stream (async_finish), else the caller's
        self.on_comm = False
        #: work of an earlier call may still run on the communication / the caller's stream
        self._comm_dirty = self._caller_dirty = False
        self._op = 0
        #: the call plans made for this Buffer's handles (modes.intranode_replay), dropped when it closes
        self.plans = weakref.WeakSet()
        self.dispatch_seq = 0
        self.host_waits = {"meet": 0, "poll": 0}
        #: this rank's call card and its count of collective calls (named disagreements)
        self._card, self._calls = comm.card(comm.rank), 0
        #: dispatches with num_worst_tokens since the last re-synchronisation (equal on ranks in step)
        self.worst_calls = 0
        #: weak references to what else shares this Runtime's re-synchronisation meeting (the Buffer's
        #: low-latency state within one host; at most one: it owns the slot's words after the header): each
        #: referent's ``resync_fill(slot)`` writes its words before the meeting, its ``resync_apply(slots)`` reads
        #: every rank's after it
        self.resync_parts: list = []
        # a rank that leaves the group says so in its card too (peers may wait there: every_worst)
        self.sig.on_leave = lambda: card.mark_failed(self._card, card.LEFT)
        self.sig.explain_mismatch = self.explain_mismatch
        # ranks that are processes of one host: a watcher thread looks at the peers' liveness locks and sets a
        # dead peer's DEAD word, which the kernels' waits read (transport.liveness); it stops when the Comm closes
        # (or this Runtime is dropped)
        live = comm.liveness
        if live is not None:
            self.sig.dead_peers = live.dead_peers
            live.watch(self.sig.dead_marker())
            weakref.finalize(self, live.close)

    # ------------------------------------------------------------------ lifetime
    def live(self) -> ipc.Comm:
        """The shared buffers; ``EPError`` once the Buffer was destroyed."""
        if self.comm is None:
            raise EPError(f"rank {self.rank}: this Buffer was destroyed")
        return self.comm

    def close(self) -> None:
        """Release the shared buffers, waiting first for kernels still queued (each of their waits is bounded
        by ``timeout_s``). Idempotent."""
        if self.comm is not None:
            try:
                if self.comm_stream is not None:
                    self.comm_stream.synchronize()
                self.comm.sync_device()
            finally:
                for p in list(self.plans):
                    p.drop()
                self.comm.close()
                self.comm = None

    def agree_on_layout(self) -> None:
        """Every rank publishes where its low-latency area lies (its offset, the normal-mode part rounded from
        ``num_nvl_bytes``, and its bytes: 0 without ``low_latency_mode``) and meets the others: the kernels
        address a peer's area at this rank's own offset, so ranks must agree. Ranks simulated in one process
        (no group) skip it. On failure the shared buffers are released.

        Raises:
            ValueError: on every rank, when ranks disagree (naming the first rank that differs).
            EPTimeoutError: a rank did not arrive within ``timeout_s``.
        """
        if self.group is None:
            return
        try:
            self._agree_on_layout(self.ll_offset, self.ll_bytes)
        except BaseException:
            self.close()
            raise

    def _agree_on_layout(self, nvl_part: int, ll_bytes: int) -> None:
        c = self.comm
        mine = (0x4C4C, ll_bytes, nvl_part if ll_bytes else 0)
        c.slot(1, self.rank)[:3] = mine       # parity-1 slots: the first exchange of a call uses parity 0
        c.barrier("bootstrap/low-latency area")
        for r in range(self.group_size):
            theirs = tuple(int(v) for v in c.slot(1, r)[:3])
            if theirs != mine:
                def says(v):
                    return (f"low_latency_mode=True, a low-latency area of {v[1]} bytes (num_rdma_bytes) after "
                            f"{v[2]} normal-mode bytes (num_nvl_bytes)" if v[1] else "low_latency_mode=False")
                raise ValueError(
                    f"rank {self.rank}: rank {r} built its Buffer with {says(theirs)}; this rank with {says(mine)}; "
                    f"every rank must pass the same low_latency_mode, num_rdma_bytes and (in low-latency mode) "
                    f"num_nvl_bytes")

    # ------------------------------------------------------------------ errors
    def check(self) -> None:
        """Raise what the kernels recorded since the last check (see ``Buffer.check``).

        Raises:
            EPTimeoutError, EPRemoteError, ValueError: each recorded error once. EPError: destroyed, or
            unusable after an earlier failure.
        """
        comm = self.live()
        err = self.sig.error()
        if err is None:
            if comm.broken:                 # reported once already: the Buffer stays unusable
                raise EPError(f"rank {self.rank}: this Buffer is unusable after an earlier failure ({comm.broken}); "
                              f"destroy() it and build a new one")
            return
        if self.sig.permanent() and comm.broken is None:
            comm.broken = str(err)
        err._ep_recorded = True             # the kernel that recorded it told the peers already
        raise collective(err)

    def tell_failure(self, e: BaseException) -> None:
        """This rank's call raises ``e``: unless the kernel that recorded it told the peers already, mark the
        call's card failed (a peer waiting on the host for it stops at once) and post the failure word (their
        kernels waiting for this rank's part stop and raise ``EPRemoteError``). What :func:`steps` does."""
        if self.comm is not None and not getattr(e, "_ep_recorded", False):
            card.mark_failed(self._card, self._calls)
            # the failure word names the round after this rank's completed ones: its earlier calls'
            # kernels must have finished (so a peer still in one of those is not told it failed)
            self.wait_comm_stream()
            self.sig.post_local_failure()

    def broke_mid_call(self, e: BaseException) -> None:
        """``e`` (not raised on every rank alike) stopped this rank after its call started launching: it can no
        longer keep step with its peers, so its Comm is marked broken and it leaves the group (its peers stop
        waiting for it at once). What :meth:`run` does."""
        comm = self.comm
        if comm is not None and not getattr(e, "_ep_collective", False) and comm.broken is None:
            comm.broken = f"rank {self.rank} failed in the middle of a call ({type(e).__name__}: {e})"
            self.sig.leave(int(F.STAGE_FAILED))             # its peers stop waiting for it at once

    @property
    def exchanges(self) -> int:
        """Host exchanges (re-synchronisations) this rank made so far: a plan made before one is stale."""
        return self._op

    def count_call(self) -> None:
        """A collective call starts (its card carries the count; :func:`steps` counts its calls, the
        low-latency calls count themselves)."""
        self._calls += 1

    def publish(self, code: int, values: Sequence[int]) -> None:
        """Write this call's card (:mod:`triton_ep.protocol.call_card`) where the peers can read it: a
        mismatch the kernels find is then raised naming the field and each rank's value."""
        card.write(self._card, self._calls, code, values)

    def publish_worst(self, value: int) -> None:
        """Publish this rank's ``num_worst_tokens`` of the dispatch it starts, in its call card (which every
        rank of the host maps); :meth:`every_worst` reads every rank's, after the call's next step."""
        self.worst_calls += 1
        card.publish_worst(self._card, self.worst_calls, self._calls, value)

    def every_worst(self) -> list:
        """Every rank's ``num_worst_tokens`` of this dispatch (:meth:`publish_worst`), read from the call cards
        with a bounded wait on the peers' host (no device synchronisation). The ranks may pass different
        values (DeepEP's contract: each sizes that rank's outputs); the call's rounds follow from all of
        them. Call it a step after :meth:`publish_worst` (in the lock-step runner every rank has then
        published).

        Raises:
            EPRemoteError: a peer gave this call up before launching anything, or its process is gone (its
                liveness lock, looked at every 50 ms). ValueError: a peer called another operation here.
                EPTimeoutError: a peer did not reach the call within ``timeout_s``.
        """
        comm = self.live()
        k, serial = self.worst_calls, self._calls
        vals = [None] * self.group_size
        deadline = time.monotonic() + self.timeout_s
        next_live = 0.0
        while True:
            for r in range(self.group_size):
                if vals[r] is not None:
                    continue
                theirs = comm.card(r)
                vals[r] = card.worst_of(theirs, k, serial)
                if vals[r] is not None:
                    continue
                # (the peers raise too, at this step: the group stays in step)
                if int(theirs[card.FAILED_WORD]) in (serial, card.LEFT):
                    raise collective(EPRemoteError(
                        f"rank {self.rank}: rank {r} gave this dispatch up before it started, or left the group "
                        f"(rank {r} raised the details); nothing was moved"))
                if int(theirs[0]) > serial or (int(theirs[0]) == serial and int(theirs[1]) != card.DISPATCH_WORST):
                    what = card.describe(self._card, theirs, self.rank, r) or "the operation"
                    raise collective(ValueError(f"ranks disagree at 'dispatch': {what}; all ranks must make the "
                                                f"same calls (num_worst_tokens > 0 on every rank, or on none)"))
            if all(v is not None for v in vals):
                return vals
            self.check()
            if self.sig.dead_peers is not None and time.monotonic() >= next_live:     # every 50 ms
                next_live = time.monotonic() + 0.05
                dead = [r for r in self.sig.dead_peers() if vals[r] is None]
                if dead:
                    comm.broken = f"rank {dead[0]}'s process is gone"
                    raise dead_error(self.rank, dead, "dispatch/num_worst_tokens of every rank (the host)")
            if time.monotonic() > deadline:
                raise EPTimeoutError(self.rank, [r for r, v in enumerate(vals) if v is None],
                                     "dispatch/num_worst_tokens of every rank (the host)", self.timeout_s)
            time.sleep(0)

    def explain_mismatch(self, peer: int) -> Optional[str]:
        """What differs between this rank's latest call and ``peer``'s, from their cards (``None``: unknown).
        The record may name a peer that agrees with this rank (one that found the disagreement first and told
        everyone): then the first rank whose card differs from this rank's is named instead."""
        c = self.comm
        if c is None or c.ctrl is None:
            return None
        mine = c.card(self.rank)
        for r in [peer] + [r for r in range(self.group_size) if r not in (peer, self.rank)]:
            what = card.describe(mine, c.card(r), self.rank, r)
            if what is not None:
                return what
        return None

    @staticmethod
    def fail_call(err: BaseException) -> BaseException:
        """This rank rejects a call its peers run without a host wait: they learn it from the failure word
        :func:`steps` posts and raise ``EPRemoteError``; the Buffer stays usable."""
        err._ep_collective = True
        return err

    def check_tensor(self, name: str, t, dtypes: Sequence[torch.dtype], shape: Sequence[Optional[int]],
                     why: str = "") -> Tensor:
        """:func:`triton_ep.runtime.checks.check_tensor` on this Buffer's device."""
        return check_tensor(name, t, dtypes, shape, self.device, why)

    def check_handle(self, handle, kind: type, made_by: str):
        """``handle`` as given, when it is a ``kind`` made by this Buffer's ``made_by`` call.

        Raises:
            TypeError: not a ``kind``. ValueError: made by another Buffer.
        """
        if not isinstance(handle, kind):
            what = ("the handle of a dispatch across hosts (this Buffer's ranks are on one host)"
                    if type(handle).__name__ == "InternodeHandle" else type(handle).__name__)
            raise TypeError(f"handle must be the handle {made_by} of triton_ep returned, got {what}")
        if handle.buffer_uid != self.uid:
            raise ValueError(f"handle was made by another Buffer; pass the handle this Buffer's {made_by} returned")
        return handle

    def check_num_experts(self, num_experts) -> None:
        """:func:`triton_ep.runtime.checks.check_num_experts` for this group."""
        check_num_experts(num_experts, self.group_size)

    # ------------------------------------------------------------------ streams
    def comm_ctx(self):
        """Run what follows on the stream of the running call: the communication stream for a call with
        ``async_finish``, else the caller's (a no-op on CPU)."""
        return torch.cuda.stream(self.comm_stream) if self.on_comm else _NO_CTX

    def begin(self, previous_event: Optional[EventOverlap], async_finish: bool) -> None:
        """Order the call's kernels after the caller's work.

        With ``async_finish`` (DeepEP's overlap) they run on the communication stream, which first waits
        for ``previous_event`` or, without one, for the caller's current stream. Without it the caller's
        stream would wait for the communication stream right after the call, so the kernels run on the
        caller's stream itself (after ``previous_event``, if given): the same order, without two
        cross-stream waits per call. Calls of one Buffer stay in issue order across the two streams: a
        call on one stream first waits for work the other still holds from an earlier call."""
        self.on_comm = False
        if self.comm_stream is None:
            return
        ev = previous_event.event if previous_event is not None else None
        if not async_finish:
            current = None
            if self._comm_dirty:          # an earlier call's kernels still run on the communication stream
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(self.comm_stream)
                self._comm_dirty = False
            if ev is not None:
                (current or torch.cuda.current_stream(self.device)).wait_event(ev)
            self._caller_dirty = True
            return
        self.on_comm = True
        if ev is not None:
            self.comm_stream.wait_event(ev)
        if ev is None or self._caller_dirty:   # earlier calls' kernels ran on the caller's stream
            self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._caller_dirty = False

    def wait_comm_stream(self) -> None:
        """Wait for work the communication stream may still hold (an ``async_finish`` call's, or the running
        one's): an error path or a host rendezvous needs this rank's device work finished."""
        if self.comm_stream is not None and (self._comm_dirty or self.on_comm):
            self.comm_stream.synchronize()

    def end(self, async_finish: bool, tensors: Sequence[Optional[Tensor]]) -> EventOverlap:
        """Hand the call's results to the caller: with ``async_finish`` an event on the communication
        stream (the tensors are marked as used there, so the caching allocator keeps them until then);
        else the work is on the caller's stream already."""
        if not self.on_comm:
            return EventOverlap(None, check=self.check)
        self.on_comm = False
        self._comm_dirty = True
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(self.comm_stream)
        ev = torch.cuda.Event()
        ev.record(self.comm_stream)
        return EventOverlap(ev, check=self.check)

    # ------------------------------------------------------------------ the collective driver
    def run(self, gen: Generator):
        """Drive a collective's steps: meet the other ranks at its host steps (:class:`Meet`); every other
        step is a phase boundary the kernels synchronise on the device. A rank that fails in the middle of
        a call (with an error its peers do not share: out of memory, an interrupt) can no longer keep step
        with them: it tells them (they raise at once instead of waiting) and its Comm is marked broken, so
        it never meets them at a wrong step. Returns the generator's value."""
        comm = self.live()
        started = False
        try:
            stage = next(gen)
            while True:
                started = True
                if isinstance(stage, Meet):
                    # this rank's device work must have finished (the rendezvous compares round counters)
                    self.wait_comm_stream()
                    try:
                        comm.barrier(stage, gone=self.sig.gone_peers)
                    except EPTimeoutError:
                        self.sig.leave(int(F.STAGE_HOST))     # the peers must not wait for this rank
                        raise
                stage = next(gen)
        except StopIteration as stop:
            return stop.value
        except BaseException as e:
            if started:
                self.broke_mid_call(e)
            raise
        finally:
            gen.close()

    def resync_steps(self) -> Generator:
        """After an error: meet every rank on the host and start the round counters afresh above the highest
        round any rank used. The meeting is every mode's that shares this Runtime (a normal-mode call's and a
        low-latency call's alike clear the error state they share): each of ``resync_parts`` adds its words after
        the slot header (``ipc.SLOT_HEADER``) and reads every rank's after the meeting.

        Raises:
            EPError: on every rank, when the ranks have met on the host a different number of times (they
                called different operations): the Buffer is broken.
        """
        comm = self.live()
        # what the meeting's words read (the round counters, the low-latency call numbers) was written by work
        # that may still be queued on the communication stream (async_finish): wait for it first
        self.wait_comm_stream()
        parity = self._op & 1
        self._op += 1
        # the count of num_worst_tokens dispatches starts afresh on every rank (the values already published
        # name their calls' serials: none is read as a later call's)
        self.worst_calls = 0
        slot = comm.slot(parity, self.rank)
        slot[:ipc.SLOT_HEADER] = 0
        with self.comm_ctx():
            slot[_BASE], slot[_HASERR] = self.sig.local_state()
        slot[_SEQ] = self.dispatch_seq
        slot[_XN] = self._op          # this rank's exchange count: equal on ranks in step
        parts = [p for p in (ref() for ref in self.resync_parts) if p is not None]
        for part in parts:
            part.resync_fill(slot)
        self.host_waits["meet"] += 1
        yield Meet("resync after an error")
        slots = [comm.slot(parity, r).copy() for r in range(self.group_size)]
        behind = [r for r, sl in enumerate(slots) if sl[_XN] != slot[_XN]]
        if behind:
            # a rank made another number of host exchanges (ranks called different operations, e.g. a
            # dispatch against a combine): the host meeting points no longer pair up
            comm.broken = (f"ranks out of step: rank {behind[0]} has met the others on the host a different number "
                           f"of times (the ranks called different operations)")
            raise collective(EPError(f"rank {self.rank}: {comm.broken}; destroy() and rebuild the Buffer"))
        # Every rank's device work has finished (each synchronised before it arrived): after an error,
        # or if round counters differ, every rank starts afresh above the highest round any rank used.
        bases = [int(s[_BASE]) for s in slots]
        # dispatch numbers name handles in call signatures: after a call that only some ranks made, they
        # agree again from here on
        self.dispatch_seq = max(int(s[_SEQ]) for s in slots)
        if any(s[_HASERR] for s in slots) or len(set(bases)) > 1:
            with self.comm_ctx():
                self.sig.resync(max(bases) + 1)
        for part in parts:
            part.resync_apply(slots)

    def capacity(self, row_bytes: int, stage: str) -> int:
        """Rows of ``row_bytes`` that fit the smallest buffer of the group (what one round may move).

        Raises:
            ValueError: on every rank, when not even one fits.
        """
        cap = self.live().min_bytes // row_bytes
        if cap < 1:      # the same on every rank: computed from shared values
            raise collective(ValueError(
                f"'{stage}': a row needs {row_bytes} bytes but the smallest rank buffer holds "
                f"{self.comm.min_bytes} (num_nvl_bytes, rounded up to 4 KiB); raise num_nvl_bytes "
                f"(see Config.get_nvl_buffer_size_hint)"))
        return cap


def current_event() -> EventOverlap:
    """``Buffer.capture``: an event recorded on the current CUDA stream (``EventOverlap(None)`` on CPU)."""
    if not torch.cuda.is_available():
        return EventOverlap(None)
    ev = torch.cuda.Event()
    ev.record()
    return EventOverlap(ev)


def ll_area_bytes(num_rdma_bytes: int) -> int:
    """Bytes of a low-latency area for ``num_rdma_bytes``: rounded up to 4 KiB."""
    return (int(num_rdma_bytes) + 4095) // 4096 * 4096


def open_runtime(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode: bool, timeout_s, device,
                 rdma_backend: Optional[str] = None) -> Runtime:
    """Build one rank's :class:`Runtime` for a Buffer (collective over ``group``): check the constructor's
    values, bootstrap the group's shared buffers (:func:`triton_ep.transport.ipc.open_group`: the normal-mode
    part of ``num_nvl_bytes`` rounded up to 4 KiB, then, with ``low_latency_mode``, the low-latency area of
    ``num_rdma_bytes``), and return the runtime. ``group`` may be an ``ipc.Comm`` (ranks simulated in one
    process, :mod:`triton_ep.testing`). A rank that rejects its values (constructor arguments,
    ``TRITON_EP_TIMEOUT_S``, ``TRITON_EP_SHM_TAG``, ``TRITON_EP_RDMA``) carries the rejection in the host
    exchange: every rank raises it at once (:class:`~triton_ep.runtime.checks.Rejected`); a rank that fails
    otherwise tells its peers (they raise ``EPRemoteError`` at once instead of waiting). The ranks are grouped
    into hosts and the transport between hosts chosen (:mod:`triton_ep.runtime.hosts`; ``rdma_backend``:
    ``"auto"``, ``"verbs"``, ``"emulated"`` or ``None`` for ``TRITON_EP_RDMA``).

    Ranks on several hosts get a :class:`HostsRuntime` instead: each host's ranks share their own buffers
    (nothing is mapped between hosts, which may be different machines).

    Raises:
        ValueError: a bad value on any rank (``num_nvl_bytes``, ``num_rdma_bytes``, ``timeout_s``,
            ``rdma_backend``, ``device``, the environment's), no process group, ranks that disagree on
            ``rdma_backend`` or ``TRITON_EP_RANKS_PER_HOST``, hosts of different sizes, a host whose ranks run on
            several machines, several hosts and no RDMA transport.
        EPTimeoutError: ranks did not arrive within ``timeout_s`` (named).
        EPRemoteError: a peer gave up or failed first.
    """
    exchanges = []
    if not isinstance(group, ipc.Comm):
        if group is None and not dist.is_initialized():
            raise ValueError("Buffer(group=None) needs torch.distributed initialised (init_process_group) "
                             "or an explicit group")
        group = group if group is not None else dist.group.WORLD
        # made before the checks below: a rank that rejects its arguments tells its peers at once
        exchanges = [Exchange(group, DEFAULT_TIMEOUT_S, "bootstrap: exchange host identities"),
                     Exchange(group, DEFAULT_TIMEOUT_S, "bootstrap: exchange buffer handles")]
    try:
        timeout_s, backend, device, rejected = _buffer_args(group, exchanges, num_nvl_bytes, num_rdma_bytes,
                                                            timeout_s, device, rdma_backend)
        if not exchanges:
            size = group.size
            hosts = group_hosts([host_identity()] * size, [os.environ.get(ENV_RANKS_PER_HOST)] * size)
            return Runtime(group, timeout_s, uuid.uuid4().hex, hosts=hosts,
                           rdma_transport=choose_transport(backend, hosts))
        if rejected is None:
            for ex in exchanges:
                ex.timeout_s = timeout_s
        hosts, transport = _find_hosts(exchanges[0], backend, rejected)
    except Exception as e:
        for ex in exchanges:
            ex.fail(f"rejected its Buffer arguments ({type(e).__name__}: {e})")
        raise
    if hosts.num_hosts > 1:
        return _open_hosts(group, hosts, transport, num_nvl_bytes, timeout_s, device)
    # the low-latency area follows the normal-mode part of the same shared buffer (every rank maps it),
    # which normal-mode rounds never touch
    nvl_part = max(4096, (int(num_nvl_bytes) + 4095) // 4096 * 4096)
    ll_bytes = ll_area_bytes(num_rdma_bytes) if low_latency_mode else 0
    comm = ipc.open_group(group, nvl_part + ll_bytes, device, timeout_s, exchange=exchanges[1])
    comm.min_bytes -= ll_bytes
    return Runtime(comm, timeout_s, uuid.uuid4().hex, group, nvl_part, ll_bytes, hosts, transport)


def _buffer_args(group, exchanges: list, num_nvl_bytes, num_rdma_bytes, timeout_s, device, rdma_backend):
    """The constructor's values checked (``open_runtime``'s): ``(timeout_s, backend, device, rejected)``. Over a
    process group (``exchanges``) a rejected value is not raised but returned as ``rejected``: it is carried in the
    host exchange, and every rank raises it at once instead of its peers waiting."""
    rejected = backend = None
    try:
        timeout_s = timeout_arg(timeout_s)
        bytes_arg("num_nvl_bytes", num_nvl_bytes)
        bytes_arg("num_rdma_bytes", num_rdma_bytes)
        ipc.shm_tag()       # (it names the shared-memory files: checked before any is made)
        backend = rdma_backend_arg(rdma_backend)
        device = device_arg(device) if exchanges else device
    except (ValueError, TypeError) as e:
        if not exchanges:
            raise
        rejected = Rejected.of(e, group.rank())
    return timeout_s, backend, device, rejected


def _find_hosts(exchange: Exchange, backend: Optional[str], rejected: Optional[Rejected] = None):
    """Exchange host identities (and each rank's ``TRITON_EP_RANKS_PER_HOST``, ``rdma_backend`` and the
    rejection of its own constructor values, ``None`` where it has none), group the ranks into hosts and choose
    the transport between them: ``(Hosts, transport)``. Every rank raises the same error where the exchanged
    values are at fault (a rank's rejection first)."""
    info = exchange.gather((host_identity(), os.environ.get(ENV_RANKS_PER_HOST), backend, rejected,
                            _qos_rejection(exchange.rank)))
    raise_rejected([i[3] for i in info])
    agreed("rdma_backend / TRITON_EP_RDMA", [i[2] for i in info])
    hosts = group_hosts([i[0] for i in info], [i[1] for i in info])
    if hosts.num_hosts > 1:     # (the transport between hosts reads them)
        raise_rejected([i[4] for i in info])
    transport = choose_transport(backend, hosts)
    for h in range(hosts.num_hosts):       # a host's ranks share memory: they must run on one machine
        machines = sorted({info[r][0] for r in hosts.ranks(h)})
        if len(machines) > 1:
            raise ValueError(f"{ENV_RANKS_PER_HOST} puts ranks {list(hosts.ranks(h))} into host {h}, but they run on "
                             f"{len(machines)} machines ({', '.join(machines)}); a host's ranks must share a machine")
    return hosts, transport


def _qos_rejection(rank: int) -> Optional[Rejected]:
    """This rank's rejection of ``TRITON_EP_RDMA_TC`` / ``TRITON_EP_RDMA_SL`` (``verbs.QoS.resolve``), or ``None``:
    exchanged at set-up so that a bad value on one rank raises on every rank, where ranks span hosts."""
    try:
        verbs.QoS.resolve()
    except ValueError as e:
        return Rejected.of(e, rank)
    return None


def _open_hosts(group, hosts: Hosts, transport: str, num_nvl_bytes: int, timeout_s: float, device) -> "HostsRuntime":
    """The :class:`HostsRuntime` of a Buffer whose ranks span several hosts (collective over ``group``): a
    process group per host and one per local index (every rank makes every subgroup, in the same order), and
    this host's own runtime (its ranks' shared buffers, of ``num_nvl_bytes``)."""
    def world(ranks):           # hosts number the ranks of ``group``; new_group takes global ranks
        return [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in ranks]

    me = group.rank()
    with _no_split_source():
        local_groups = [dist.new_group(world(hosts.ranks(h))) for h in range(hosts.num_hosts)]
        peer_groups = [dist.new_group(world([hosts.ranks(h)[i] for h in range(hosts.num_hosts)]))
                       for i in range(hosts.ranks_per_host)]
    host = hosts.host_of[me]
    mine = (local_groups[host], peer_groups[hosts.local_index(me)])
    try:
        local = open_runtime(local_groups[host], num_nvl_bytes, 0, False, timeout_s, device)
    except BaseException:
        _destroy_groups(mine)
        raise
    try:
        local.agree_on_layout()
    except BaseException:
        try:
            local.close()
        finally:
            _destroy_groups(mine)
        raise
    return HostsRuntime(local, group, me, group.size(), hosts, transport, local_groups[host],
                        peer_groups[hosts.local_index(me)])


@contextlib.contextmanager
def _no_split_source():
    """While the block makes subgroups: a default group bound to a device (``init_process_group(device_id=...)``,
    as DeepEP's test programs call it) whose backend cannot split (gloo) is unbound. torch then makes a subgroup
    by splitting the bound backend, and on the ranks outside the subgroup calls its ``perform_nocolor_split``,
    which gloo lacks (torch 2.11: ``AttributeError``); unbound, every subgroup is made the plain way."""
    pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    bound = getattr(pg, "bound_device_id", None)
    if bound is None:
        yield
        return
    try:
        splits = hasattr(pg._get_backend(bound), "perform_nocolor_split")
    except RuntimeError:                # no backend for that device: nothing to split from either
        splits = True
    if splits:
        yield
        return
    pg.bound_device_id = None
    try:
        yield
    finally:
        pg.bound_device_id = bound


def _destroy_groups(groups) -> None:
    """Release the process groups a Buffer made for itself (each holds sockets and threads)."""
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except Exception:       # noqa: BLE001 - already gone (the default group was destroyed first)
            pass


class HostsRuntime:
    """The runtime of a Buffer whose ranks span several hosts: the group's view (global rank and size, hosts,
    the transport between them) over this host's own :class:`Runtime` (``local``: the shared buffers,
    signals and streams of this host's ranks). Nothing is mapped between hosts. The group-wide argument
    checks and the routing layout use it as they use a :class:`Runtime`; the data moves through
    :mod:`triton_ep.modes.internode`.

    Attributes:
        local: this host's runtime. local_group: the process group of this host's ranks. peer_group: the
        process group of the ranks with this rank's local index on every host (its RDMA peers). group, rank,
        group_size, hosts, num_hosts, rdma_transport, timeout_s, device, uid: as :class:`Runtime`'s.
    """

    ll_offset = ll_bytes = 0

    def __init__(self, local: Runtime, group, rank: int, size: int, hosts: Hosts, rdma_transport: str,
                 local_group, peer_group) -> None:
        self.local, self.group, self.rank, self.group_size = local, group, rank, size
        self.hosts, self.num_hosts, self.rdma_transport = hosts, hosts.num_hosts, rdma_transport
        self.local_group, self.peer_group = local_group, peer_group
        self._groups = (local_group, peer_group)
        self.timeout_s, self.device, self.uid = local.timeout_s, local.device, local.uid

    @property
    def comm(self):
        """This host's shared buffers (``None`` once closed)."""
        return self.local.comm

    @property
    def comm_stream(self):
        return self.local.comm_stream

    def live(self) -> ipc.Comm:
        if self.local.comm is None:
            raise EPError(f"rank {self.rank}: this Buffer was destroyed")
        return self.local.comm

    def check(self) -> None:
        self.local.check()

    def close(self) -> None:
        """Release this host's shared buffers, then the host's and the RDMA peers' process groups. Idempotent."""
        try:
            self.local.close()
        finally:
            # gloo frees a group's sockets and threads once nothing refers to it: drop every reference
            groups, self._groups = self._groups, ()
            self.local_group = self.peer_group = self.local.group = None
            _destroy_groups(groups)

    def agree_on_layout(self) -> None:
        """Done by this host's runtime at construction."""

    def check_tensor(self, *args, **kwargs) -> Tensor:
        return self.local.check_tensor(*args, **kwargs)

    def check_num_experts(self, num_experts) -> None:
        """:func:`triton_ep.runtime.checks.check_num_experts` for the whole group (every host's ranks)."""
        check_num_experts(num_experts, self.group_size)

    def comm_ctx(self):
        return self.local.comm_ctx()

    def begin(self, previous_event, async_finish: bool) -> None:
        self.local.begin(previous_event, async_finish)

    def end(self, async_finish: bool, tensors) -> EventOverlap:
        return self.local.end(async_finish, tensors)

    def wait_comm_stream(self) -> None:
        self.local.wait_comm_stream()

