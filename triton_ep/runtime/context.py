"""What every mode of one Buffer shares: the group's shared buffers and signals, stream order, error checks,
call cards and the driver of a collective's steps (:meth:`Runtime.run`; the steps themselves:
:mod:`triton_ep.runtime.call_steps`).

A mode (:mod:`triton_ep.modes`) gets one :class:`Runtime` and uses only its public members.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Generator, Optional, Sequence

import torch

from ..kernels._util import interpreted, num_sms
from ..config import EventOverlap
from ..errors import EPError, EPRemoteError, EPTimeoutError
from ..kernels import flags as F
from ..protocol import call_card as card
from ..transport import ipc, signals
from ..transport.liveness import left_error, left_phrase
from .hosts import Hosts
from .call_steps import Meet, collective
from .checks import check_num_experts, check_tensor, handle_error

Tensor = torch.Tensor
_NO_CTX = contextlib.nullcontext()        # reusable: entering it does nothing
# Exchange-slot header words (int64), ipc.SLOT_HEADER of them.
_BASE, _HASERR, _SEQ, _XN = 12, 13, 14, 15   # rounds completed, holds an error, dispatches, exchange number


def _release_dropped(live, comm: ipc.Comm, host_block, resync_box: list) -> None:
    """A Runtime dropped without ``close()`` (a Buffer collected, or left at its process's exit, e.g. after an
    uncaught error): release its liveness lock, saying how (from its Comm's ``broken``, its host block's record and
    ``resync_box``, its Signals' ``[needs_resync]``: an error it raised and told its peers of makes peers name that
    failure, not a clean close)."""
    live.close(how=signals.closing_state(host_block, comm.broken is not None, resync_box[0]))


def live_comm(comm: Optional[ipc.Comm], rank: int, pid: int) -> ipc.Comm:
    """``comm`` of a Buffer built by process ``pid``, as a call of rank ``rank`` may use it: ``EPError`` once it
    was destroyed (``comm`` None), or in a process forked from that one (its calls would pair with the peers' in
    the parent's place, which then fails)."""
    if comm is None:
        raise EPError(f"rank {rank}: this Buffer was destroyed")
    if os.getpid() != pid:
        raise EPError(f"rank {rank}: this Buffer was built by process {pid}; process {os.getpid()} was forked from "
                      f"it and may not call it (build a Buffer of its own there)")
    return comm


class Runtime:
    """One rank's shared machinery for one Buffer.

    Args:
        comm: the group's shared buffers (:class:`triton_ep.transport.ipc.Comm`).
        timeout_s: bound on every wait for a peer, in seconds.
        uid: the Buffer's unique id (handles name it).
        group: the process group, ``None`` for ranks simulated in one process.
        hosts: which ranks share a host (:class:`~triton_ep.runtime.hosts.Hosts`; default: one host).
        rdma_transport: the transport between hosts, ``None`` for one host, ``"emulated"`` or ``"verbs"``.
        see_closed: whether a peer that destroyed its Buffer ends the waits for it at once, as a dead one does (its
            liveness byte, :mod:`triton_ep.transport.liveness`): a Buffer's own group within one host. ``False`` for a
            host's runtime under a Buffer across hosts, whose close words name such a peer.

    Attributes:
        comm, sig (:class:`~triton_ep.transport.signals.Signals`), sig_args (what signalling kernels take),
        rank, group_size, device, timeout_s, uid, group, delta_words (int64 ``[R]``: peer buffers minus this
        one, in 32-bit words), comm_stream (``None`` on CPU), dispatch_seq (dispatches so far, the same on
        every rank: names handles), host_waits (``{"meet": n, "poll": n}``: host rendezvous and count polls
        so far, read by :func:`triton_ep.testing.host_waits`), hosts, num_hosts, rdma_transport.
    """

    def __init__(self, comm: ipc.Comm, timeout_s: float, uid: str, group=None, ll_offset: int = 0,
                 ll_bytes: int = 0, hosts: Optional[Hosts] = None, rdma_transport: Optional[str] = None,
                 see_closed: bool = True) -> None:
        self.comm, self.timeout_s, self.uid, self.group = comm, float(timeout_s), uid, group
        #: the process that built the Buffer: a process forked from it may not call it (:meth:`live`)
        self.pid = os.getpid()
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
        self.sig_args["sms"] = num_sms(comm.device)      # (the normal-mode launches' grid cap, kernels.geometry.programs)
        # (split send / receive launches skip their end-of-launch counts where ranks run concurrently:
        # kernels.geometry.defer)
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
        #: the peers' cards (rank, int64 view): a call's start reads them for a call of the other mode
        self._peer_cards = [(r, comm.card(r)) for r in range(comm.size) if r != comm.rank]
        #: dispatches with num_worst_tokens since the last re-synchronisation (equal on ranks in step)
        self.worst_calls = 0
        #: weak references to what else shares this Runtime's re-synchronisation meeting (the Buffer's
        #: low-latency state within one host; at most one: it owns the slot's words after the header): each
        #: referent's ``resync_fill(slot)`` writes its words before the meeting, its ``resync_apply(slots)`` reads
        #: every rank's after it
        self.resync_parts: list = []
        # a rank that leaves the group says so in its card too (peers may wait there: every_worst)
        self.sig.on_leave = lambda: self._card is not None and card.mark_failed(self._card, card.LEFT)
        self.sig.explain_mismatch = self.explain_mismatch
        # ranks that are processes of one host: a watcher thread looks at the peers' liveness locks and sets the
        # DEAD word of a dead peer (and with see_closed of one that destroyed its Buffer), which the kernels' waits
        # read (transport.liveness); it stops when the Comm closes (or this Runtime is dropped: its lock is then
        # released saying how, from what the Comm and the host block hold)
        live = comm.liveness
        if live is not None:
            live.closes_leave = bool(see_closed)
            self.sig.dead_peers = live.left_peers
            mark = self.sig.dead_marker()
            live.watch(mark, on_closed=mark if see_closed else None)
            weakref.finalize(self, _release_dropped, live, comm, self.sig.host.numpy(), self.sig.resync_box)

    # ------------------------------------------------------------------ lifetime
    def live(self) -> ipc.Comm:
        """The shared buffers; ``EPError`` once the Buffer was destroyed, or in a process forked from the one that
        built it (its calls would pair with the peers' in the parent's place, which then fails)."""
        return live_comm(self.comm, self.rank, self.pid)

    def close(self) -> None:
        """Release the shared buffers, waiting first for kernels still queued (each of their waits is bounded
        by ``timeout_s``), and drop every view of them this Runtime holds (the plans' launches, the signal headers,
        the call cards, the kernels' ``hdr`` argument): an object the caller keeps after ``destroy()`` (an event,
        whose check is this Runtime's, a handle, a hook) then keeps none of the shared memory mapped, with no
        garbage collection. Idempotent."""
        if self.comm is not None:
            try:
                if self.comm_stream is not None:
                    self.comm_stream.synchronize()
                self.comm.sync_device()
            finally:
                for p in list(self.plans):
                    p.drop()
                # (the liveness byte says whether this rank told its peers of an error first: transport.liveness)
                self.comm.close(self.sig.closing_state(self.comm.broken is not None))
                self.comm = None
                self.sig.release()
                self.sig_args.pop("hdr", None)     # (the dict the modes' launches share)
                self._card, self._peer_cards = None, []

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
        c.barrier("bootstrap/agree on the buffer layout")
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
        kernels waiting for this rank's part stop and raise ``EPRemoteError``; ``ValueError`` where ``e`` is a
        disagreement this rank found on the host, ``_ep_mismatch``: :meth:`every_worst`). What :func:`steps`
        does."""
        if self.comm is not None and not getattr(e, "_ep_recorded", False):
            card.mark_failed(self._card, self._calls)
            # the failure word names the round after this rank's completed ones: its earlier calls'
            # kernels must have finished (so a peer still in one of those is not told it failed)
            self.wait_comm_stream()
            self.sig.post_local_failure(F.E_MISMATCH if getattr(e, "_ep_mismatch", False) else F.E_FAILED)

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

    def count_call(self, low_latency: bool = False) -> None:
        """A collective call starts (its card carries the count; :func:`steps` counts its calls, the
        low-latency calls count themselves with ``low_latency``, before anything can refuse them, as
        :func:`steps` does): its mode goes into the card's ``modes`` word at once."""
        self._calls += 1
        card.count(self._card, self._calls, low_latency)

    def publish(self, code: int, values: Sequence[int]) -> None:
        """Write this call's card (:mod:`triton_ep.protocol.call_card`) where the peers can read it: a
        mismatch the kernels find is then raised naming the field and each rank's value.

        Then read the peers' cards: the two modes wait on different words (normal mode's signal header,
        low-latency mode's control block), so a peer that makes this call in the other mode would be waited for
        until ``timeout_s``. Each rank writes its card before it reads the others' (a full barrier between), so of
        two ranks making the call in different modes at least one sees the other's; it raises ``ValueError``
        naming both operations and tells every peer in both modes' failure words (:meth:`tell_mode_mix`), whose
        waits end at once with the same ``ValueError``; the next call re-synchronises the group.

        Raises:
            ValueError: a peer made this call in the other mode (normal against low-latency).
        """
        serial, ll = self._calls, code in card.LOW_LATENCY
        card.write(self._card, serial, code, values)
        if not self._peer_cards:
            return
        _full_barrier()
        for r, theirs in self._peer_cards:
            if card.other_mode(theirs, serial, ll):
                self.tell_mode_mix()
                err = ValueError(
                    f"ranks disagree at '{card.FIELDS[code][0]}': the operation: rank {self.rank} called "
                    f"{card.FIELDS[code][0]}, rank {r} called {card.mode_phrase(theirs, serial)}; all ranks must make "
                    f"the same calls (a normal-mode call on every rank, or a low-latency call on every rank); nothing "
                    f"was moved")
                err._ep_recorded = err._ep_told = True      # (the peers were told: tell_failure, guard)
                raise collective(err)

    def tell_mode_mix(self) -> None:
        """This rank found that a peer makes its call in the other mode: post ``E_MISMATCH`` in the failure words of
        both modes (normal mode's ``FAILED`` through :meth:`Signals.post_local_failure
        <triton_ep.transport.signals.Signals.post_local_failure>`, low-latency mode's ``LFAILED`` through the
        low-latency state among :attr:`resync_parts`), so every peer's waits end at once in either mode and raise
        ``ValueError``. This rank's next call re-synchronises the group (and restarts the low-latency call
        numbers)."""
        self.wait_comm_stream()
        self.sig.post_local_failure(F.E_MISMATCH)
        for part in [p for p in (ref() for ref in self.resync_parts) if p is not None]:
            tell = getattr(part, "post_failure", None)
            if tell is not None:
                tell(F.E_MISMATCH)

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
            gave_up = None
            for r in range(self.group_size):
                if vals[r] is not None:
                    continue
                theirs = comm.card(r)
                vals[r] = card.worst_of(theirs, k, serial)
                if vals[r] is not None:
                    continue
                # (the peers raise too, at this step: the group stays in step)
                if int(theirs[card.FAILED_WORD]) in (serial, card.LEFT):
                    gave_up = r if gave_up is None else gave_up
                    continue
                if int(theirs[0]) > serial or (int(theirs[0]) == serial and int(theirs[1]) != card.DISPATCH_WORST):
                    what = card.describe(self._card, theirs, self.rank, r) or "the operation"
                    err = ValueError(f"ranks disagree at 'dispatch': {what}; all ranks must make the same calls "
                                     f"(num_worst_tokens > 0 on every rank, or on none)")
                    err._ep_mismatch = True     # (tell_failure tells the peers it is a disagreement)
                    raise collective(err)
            if gave_up is not None:     # (after every card was looked at: a rank that found a disagreement
                # first gave up too, and the disagreement is what every rank raises)
                raise collective(EPRemoteError(
                    f"rank {self.rank}: rank {gave_up} gave this dispatch up before it started, or left the group "
                    f"(rank {gave_up} raised the details); nothing was moved"))
            if all(v is not None for v in vals):
                return vals
            self.check()
            if self.sig.dead_peers is not None and time.monotonic() >= next_live:     # every 50 ms
                next_live = time.monotonic() + 0.05
                left = {r: how for r, how in self.sig.dead_peers().items() if vals[r] is None}
                if left:
                    comm.broken = left_phrase(left)
                    raise left_error(self.rank, left, "dispatch/num_worst_tokens of every rank (the host)")
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
            TypeError: not a ``kind``: another mode's handle, or a tuple or list with an entry of another type or
            dtype (named: ``handle[3] (recv_src_idx) must be a torch.Tensor, got float``) or rebuilt from a
            handle's entries. ValueError: a tuple or list of another number of entries; made by another Buffer
            (:func:`triton_ep.runtime.checks.handle_error`).
        """
        if not isinstance(handle, kind):
            raise handle_error(handle, kind, made_by)
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


#: a lock taken and released for its memory barrier only (:func:`_full_barrier`)
_BARRIER_LOCK = threading.Lock()


def _full_barrier() -> None:
    """Order this process's earlier stores to shared memory before its later loads (a store-load barrier, which
    plain stores and loads lack): taking an uncontended lock is an atomic read-modify-write (a locked instruction on
    x86, a full barrier)."""
    _BARRIER_LOCK.acquire()
    _BARRIER_LOCK.release()


def current_event() -> EventOverlap:
    """``Buffer.capture``: an event recorded on the current CUDA stream (``EventOverlap(None)`` on CPU)."""
    if not torch.cuda.is_available():
        return EventOverlap(None)
    ev = torch.cuda.Event()
    ev.record()
    return EventOverlap(ev)
