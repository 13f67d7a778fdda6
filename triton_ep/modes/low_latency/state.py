"""The low-latency state of one Buffer: its area, the call numbers and pending hooks, errors and the
re-synchronisation after one, masking (the package's docstring has the whole)."""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from ...errors import EPError
from ...kernels import flags as F, logfmt
from ...kernels.geometry import fused_switch, use_fused
from ...protocol.ll_area import Layout
from ...protocol.signal_header import ll_failure_call, ll_failure_word_of
from ...runtime import SLOT_HEADER, Runtime
from ...runtime.checks import isint
from .handle import LLHandle

Tensor = torch.Tensor

#: the stages of low-latency kernels' error records (a record of one asks for a restart of the call numbers)
_LL_STAGES = frozenset(int(st) for st in (F.STAGE_LL_DISPATCH_SEND, F.STAGE_LL_DISPATCH_RECV, F.STAGE_LL_COMBINE_SEND,
                                          F.STAGE_LL_COMBINE_RECV))


class LowLatencyState:
    """The low-latency state of one Buffer: its area (``area_bytes`` at byte ``offset`` of the Buffer's
    data buffer, the same offset on every rank), hooks still to run, and the host count of sends; the calls that
    use it are :class:`~triton_ep.modes.low_latency.calls.LowLatency`'s (the Buffer's low-latency mode)."""

    def __init__(self, rt: Runtime, offset: int, area_bytes: int, shrink: bool) -> None:
        self.rt = rt
        comm = rt.comm
        with torch.inference_mode(False):
            self.area_u8 = comm.data[offset:offset + area_bytes]
            self.area = self.area_u8.view(torch.int32)
            self.ctl = self.area_u8[:F.ll_ctl_words.host(comm.size) * 8].view(torch.int64)
            #: every rank's control block as mapped here (this rank's failure words go into the peers')
            self.peer_ctl = [p[offset:offset + F.ll_ctl_words.host(comm.size) * 8].view(torch.int64) for p in comm.peers]
        self.area_bytes = area_bytes
        self.shrink = bool(shrink)
        #: low-latency sends this Buffer has issued (the device's L_SEQ moves with them, in stream order)
        self.sent = 0
        #: sends whose receive (hook) has not run yet
        self.pending: List[int] = []
        #: (N, hidden, num_experts) of the last send: a send of other sizes waits for every peer's last receive
        self.last_sizes: Optional[tuple] = None
        #: ranks on several hosts: the network leg to every other rank (:mod:`triton_ep.modes.internode.low_latency`)
        self.net = None
        #: the plans the next dispatch and combine of the same sizes replay (:mod:`.replay`)
        self.replay_dispatch = self.replay_combine = None
        self._layouts: dict = {}
        #: this rank failed a low-latency call since the last restart of the call numbers (see resync_fill)
        self.failed = False
        #: the call number the last restart of the call numbers set (the same on every rank; 0 before any): every
        #: failure word posted before that restart names a call up to it, every later call a call above it
        self.floor = 0
        with torch.inference_mode():
            self.ctl.zero_()              # peers write here only after the construction's barrier
            # the LogFMT combine's log2 table, copied to the device here: a first combine with use_logfmt may be
            # captured into a CUDA graph, where no copy may run
            logfmt.log2_table(self.ctl.device)
        # every re-synchronisation meeting of the Runtime, a normal-mode call's too, restarts the low-latency
        # call numbers where they need it (a normal-mode meeting clears the error state both modes share)
        rt.resync_parts.append(weakref.ref(self))

    # ------------------------------------------------------------------ helpers
    def layout(self, n_max: int, hidden: int, num_experts: int) -> Layout:
        """The area's :class:`Layout` for these sizes (one object per sizes: its derived sizes are worked out
        once). Raises ``ValueError`` where the area is too small."""
        lay = self._layouts.get((n_max, hidden, num_experts))
        if lay is None:
            lay = Layout(self.rt.group_size, n_max, hidden, num_experts)
            if len(self._layouts) >= 64:
                self._layouts.clear()
            self._layouts[(n_max, hidden, num_experts)] = lay
        if lay.total_bytes > self.area_bytes:
            raise ValueError(f"the low-latency area holds {self.area_bytes} bytes but num_max_dispatch_tokens_per_rank="
                             f"{n_max}, hidden={hidden}, num_experts={num_experts} need {lay.total_bytes}; build the "
                             f"Buffer with num_rdma_bytes >= Buffer.get_low_latency_rdma_size_hint(...)")
        return lay

    def fits_network(self, lay: Layout, num_topk: int) -> None:
        """Across hosts: a call's largest chunk must fit a ring slot (it does with the size hint)."""
        if self.net is not None and lay.net_chunk_bytes(num_topk) > self.net.slot_bytes:
            raise ValueError(f"num_rdma_bytes={self.area_bytes} gives the network leg ring slots of "
                             f"{self.net.slot_bytes} bytes, but a call with num_max_dispatch_tokens_per_rank="
                             f"{lay.n_max}, hidden={lay.hidden}, num_experts={lay.num_experts} and top-{num_topk} may "
                             f"send a peer {lay.net_chunk_bytes(num_topk)}; build the Buffer with num_rdma_bytes >= "
                             f"Buffer.get_low_latency_rdma_size_hint(...)")

    def start(self) -> None:
        """What every low-latency call does first: raise recorded errors, re-synchronise after one."""
        rt = self.rt
        comm = rt.live()
        if self.net is not None:
            # across hosts: a timeout or the proxy's failure ends the low-latency calls for good; after any
            # other error the group meets through its store and starts afresh (NetLeg.resync)
            try:
                self.check()
            except Exception as ex:
                if self.net.sched.error is not None:
                    comm.broken = comm.broken or f"{type(ex).__name__}: {ex}"
                raise
            if comm.broken:
                raise EPError(f"rank {rt.rank}: this Buffer's low-latency calls across hosts are unusable after an "
                              f"earlier failure ({comm.broken}); destroy() it and build a new one")
            if rt.sig.needs_resync:
                rt.wait_comm_stream()
                comm.sync_device()
                try:
                    self.net.resync(self)
                except Exception as ex:
                    comm.broken = comm.broken or f"re-synchronisation failed: {type(ex).__name__}: {ex}"
                    raise
            return
        rt.check()
        if rt.sig.needs_resync:
            rt.run(self._resync_steps())

    def _resync_steps(self):
        """After an error: meet every rank on the host (the normal re-synchronisation; :meth:`resync_apply`
        restarts the low-latency call numbers there)."""
        self.failed = True          # (the meeting of a low-latency call restarts the numbers, as it always did)
        yield from self.rt.resync_steps()

    def resync_fill(self, slot) -> None:
        """This rank's words in a re-synchronisation meeting (any mode's): its last low-latency call number and
        whether its call numbers need a restart (it rejected a low-latency call on the host, its kernels recorded
        a low-latency call's error, or a peer's failure word naming a call since the last restart waits in its
        control block). A small device read: an error path."""
        if self.net is not None:        # (across hosts the network leg re-synchronises low-latency calls)
            return
        R = self.rt.group_size
        failed_words = self.ctl[F.off_ll_failed.host(R):F.off_ll_failed.host(R) + R]
        rec = self.rt.sig.record()
        recorded = rec is not None and rec.stage in _LL_STAGES
        slot[SLOT_HEADER] = int(self.ctl[int(F.L_SEQ)].item())
        fresh = bool((ll_failure_call(failed_words) > self.floor).any().item())
        slot[SLOT_HEADER + 1] = int(self.failed or recorded or fresh)

    def resync_apply(self, slots) -> None:
        """After a re-synchronisation meeting: where any rank failed a low-latency call, holds a peer's failure
        word or sent another number of calls, or the meeting is a low-latency call's, every rank restarts its
        low-latency call numbers above the highest any rank reached (hooks still pending are dropped); otherwise
        (a normal-mode call's meeting after a normal-mode error) nothing changes, and a pending hook still
        receives.

        The peers' failure words (``LFAILED``) are left as they are: a peer that leaves the meeting first may
        already have posted the failure of its next call here (it rejected its arguments at once, or its kernel
        found bad ids), and clearing the words would lose it (this rank would wait out ``timeout_s``). Instead the
        numbers restart one call higher: the words posted before the meeting name calls up to ``top + 1`` (the
        call after a rank's last, which it rejected), so the restart leaves ``top + 1`` unused and no such word
        matches a later call."""
        if self.net is not None:
            return
        seqs = [int(s[SLOT_HEADER]) for s in slots]
        if len(set(seqs)) == 1 and not any(int(s[SLOT_HEADER + 1]) for s in slots):
            return
        top = max(seqs) + 1
        with torch.inference_mode():
            # L_SEQ, L_DONE, CONS[0..1]; PEND[0..1] as CONS (nothing left to release)
            self.ctl[:4].copy_(torch.tensor([top, 0, top, top], dtype=torch.int64, device=self.ctl.device))
            self.ctl[int(F.L_PEND):int(F.L_PEND) + 2].fill_(top)
            self.ctl[int(F.L_DONE2)] = 0        # (a one-launch call's gate counter; GATE itself only grows)
        self.floor = top
        self.pending.clear()
        self.failed = False

    def post_failure(self, kind: int = int(F.E_FAILED)) -> None:
        """This rank rejects its next low-latency call: write that call's number into every peer's
        ``LFAILED[rank]`` (with ``kind``: ``E_FAILED``, the peers raise ``EPRemoteError``; ``E_MISMATCH``, this rank
        found that the ranks called different operations: they raise ``ValueError`` naming them), so their waits
        of that call end at once (their earlier calls, which may still be running, are not affected), and mark
        this rank for re-synchronisation (its own kernels go on: a hook of an earlier call still receives).
        Across hosts the network peers hear ``E_FAILED`` whatever ``kind``."""
        rt = self.rt
        R, me = rt.group_size, rt.rank
        rt.wait_comm_stream()
        n = int(self.ctl[int(F.L_SEQ)].item()) + 1       # a device read: an error path
        with torch.inference_mode():
            for r, pc in enumerate(self.peer_ctl):
                if r != me:
                    pc[F.off_ll_failed.host(R) + me].fill_(ll_failure_word_of(n, kind, me))
        if self.net is not None:        # the peers on the network learn it from this call's chunk
            rt.sig.needs_resync = True
            try:
                self.net.post_failure(self, n)
            except Exception as ex:     # noqa: BLE001 - the caller hears its own error; the Buffer is done
                comm = rt.live()
                comm.broken = comm.broken or f"a failure notice could not be sent ({type(ex).__name__}: {ex})"
            return
        # the rejected call launched nothing: this rank's kernels go on (a hook of an earlier call still
        # receives), and its next call re-synchronises the group with the peers that saw the failure
        rt.sig.needs_resync = True
        self.failed = True

    def one_launch(self, num_tokens: int) -> bool:
        """Whether a call of ``num_tokens`` tokens runs as one launch (:mod:`triton_ep.kernels.ll_fused`; with a
        receive hook, a dispatch's route and send as one): within one host (no network leg), as normal mode's
        calls of one round (:func:`triton_ep.kernels.geometry.use_fused`: real ranks, up to the tuning table's
        ``fused`` token limit; ``TRITON_EP_FUSED`` forces it on or off), and not while the stream is captured into a
        CUDA graph unless forced. Raises ``ValueError`` for a bad ``TRITON_EP_FUSED``."""
        force = fused_switch()
        if self.net is not None:
            return False
        if force is None and self.rt.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False        # (in a CUDA graph host time does not count, and the split launches take less GPU time)
        return use_fused(num_tokens, self.rt.group, force)

    def fence(self, lay: Layout) -> bool:
        """Whether a send of ``lay``'s sizes must wait until every peer received the last call: its sizes differ,
        so its half lies elsewhere, partly over the other half of the last call, which a slower peer may still be
        reading (:mod:`triton_ep.kernels.ll_fence`, launched before such a call's send). Raises ``ValueError``
        when that call's receive hook has not run here (the wait would need it)."""
        sizes = (lay.n_max, lay.hidden, lay.num_experts)
        if self.last_sizes is None or self.last_sizes == sizes:
            return False
        if self.pending:
            raise ValueError(f"a low-latency call with num_max_dispatch_tokens_per_rank, hidden, num_experts = {sizes} "
                             f"after calls with {self.last_sizes} waits until every rank received the last call, but "
                             f"this rank's receive hook of an earlier call has not run: call it first")
        return True

    def claim_send(self) -> int:
        """Host bookkeeping of a new send: call ``n`` reuses the half of call ``n - 2``, which must have been
        received here (at most two calls outstanding)."""
        if any(p <= self.sent - 1 for p in self.pending):
            raise ValueError("at most two low-latency calls may be outstanding, and the one before the last still "
                             "waits for its receive: call that call's hook first")
        self.sent += 1
        return self.sent

    def stats_arg(self, name: str, t: Optional[Tensor], dtype, shapes) -> Optional[Tensor]:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) not in shapes or not t.is_contiguous() or t.device != self.rt.device:
            got = (f"a non-contiguous tensor of shape {tuple(t.shape)} (strides {t.stride()})"
                   if not t.is_contiguous() else str(tuple(t.shape)))
            raise ValueError(f"{name} must be a contiguous tensor of shape {' or '.join(map(str, shapes))} on "
                             f"{self.rt.device}, got {got} on {t.device}")
        return t

    def cost_arg(self, name: str, t: Optional[Tensor]) -> Optional[Tensor]:
        R = self.rt.group_size
        t = self.stats_arg(name, t, torch.int64, [(R,), (R, R)])
        if t is not None and t.dim() == 2:       # this rank's row: waits for each source rank
            t = t[self.rt.rank]
        return t

    def next_combine_buffer(self, handle) -> Tensor:
        """``Buffer.get_next_low_latency_combine_buffer``: the zero-copy input of ``handle``'s sizes."""
        self.rt.live()
        return self.zero_copy_buffer(self.layout(*self.check_handle(handle).sizes))

    def close(self) -> None:
        """Drop this mode's views of the shared buffers (the area, the control blocks), so that a receive hook
        the caller keeps after ``destroy()`` keeps none of that memory mapped (the Buffer's runtime, which closes
        after this, holds the buffers and waits for the kernels still queued first). Across hosts
        :class:`~triton_ep.modes.internode.low_latency.LowLatencyAcrossHosts` releases its leg too."""
        self.drop_views()

    def drop_views(self) -> None:
        """Forget the views of the shared buffers (nothing may use them afterwards: every call and hook checks that
        the Buffer is alive first)."""
        self.area_u8 = self.area = self.ctl = None
        self.peer_ctl = []
        self.replay_dispatch = self.replay_combine = None

    def check(self) -> None:
        """Across hosts (``Buffer.check``): raise what this mode's RDMA proxy (first: :meth:`NetLeg.check
        <triton_ep.modes.internode.low_latency.NetLeg.check>`) and kernels recorded. Within one host the Buffer's
        runtime is this mode's, checked by the Buffer itself."""
        if self.net is not None:
            self.net.check(self.rt)
            self.rt.check()

    def raise_recorded(self) -> None:
        """The end of a call or hook: raise what the kernels recorded (``Runtime.check``). Across hosts, where they
        recorded an error, the RDMA proxy's error comes first if it failed (their waits ended when it did: the error
        to name is the proxy's, e.g. the gone rank, not the live peer a wait was for). No more than one host word
        read where nothing was recorded."""
        if self.net is not None and self.rt.sig.record() is not None:
            self.net.check(self.rt)
        self.rt.check()

    def check_handle(self, handle) -> LLHandle:
        return self.rt.check_handle(handle, LLHandle, "low_latency_dispatch")

    def zero_copy_buffer(self, lay: Layout) -> Tensor:
        """The local zero-copy combine input, bf16 ``[E_local, R*N, H]``, a view into the area."""
        start = lay.ctl_bytes + 2 * lay.half_bytes
        n = lay.experts_per_rank * lay.num_ranks * lay.n_max * lay.hidden
        return self.area_u8[start:start + 2 * n].view(torch.bfloat16).view(lay.experts_per_rank,
                                                                            lay.num_ranks * lay.n_max, lay.hidden)

    # ------------------------------------------------------------------ masking
    def _masking(self) -> None:
        """What every masking call checks first: the Buffer lives and was built with ``enable_shrink``."""
        self.rt.live()
        if not self.shrink:
            raise ValueError("rank masking needs Buffer(..., enable_shrink=True)")

    def _mask_words(self) -> Tensor:
        R = self.rt.group_size
        return self.ctl[F.off_ll_mask.host(R):F.off_ll_mask.host(R) + R]

    def _gaveup_words(self) -> Tensor:
        """``GAVEUP[s]`` of this rank's control block: nonzero where rank ``s`` gave up on this rank."""
        R = self.rt.group_size
        return self.ctl[F.off_ll_gaveup.host(R):F.off_ll_gaveup.host(R) + R]

    def _unmask_here(self, ranks) -> None:
        """Unmask ``ranks`` in this rank's control block: their ``MASK`` and ``GAVEUP`` words go to 0. Where one of
        them was masked by a wait (a timeout, a gone peer, its ``GAVEUP`` word) or gave up on this rank, the two may
        have made different numbers of calls since (a rank that skipped a call its peers made is one behind them), so
        this rank's next low-latency call re-synchronises the group first (every rank of the host meets, as after an
        error, and the call numbers restart alike): every rank involved holds such a word and unmasks too. A device
        read: masking calls are not on the fast path."""
        ranks = list(ranks)
        with torch.inference_mode():
            mask, gave = self._mask_words(), self._gaveup_words()
            idx = torch.tensor(ranks, dtype=torch.long, device=mask.device)
            waited = bool(((mask[idx] == int(F.LL_MASK_WAIT)) | (gave[idx] != 0)).any().item())
            mask[idx] = 0
            gave[idx] = 0
        if waited and self.net is None:
            self.rt.sig.needs_resync = True
            self.failed = True

    def update_mask(self, rank: int, mask: bool) -> None:
        """``Buffer.low_latency_update_mask_buffer``."""
        self._masking()
        if not isint(rank) or not 0 <= rank < self.rt.group_size:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.rt.group_size}), got {rank!r}")
        rank = int(rank)
        if self.net is not None and not mask:   # a collective across hosts, on every rank (the rank itself too)
            self._unmask_across_hosts([rank])
            return
        if not mask:
            self._unmask_here([rank])
            return
        if self.net is not None and rank in self.net.remote_ranks:
            self.net.sched.flags.mask(rank)     # its proxy drops what it still holds for that rank
        with torch.inference_mode():
            # (a mask a wait set stays one: its unmask restarts the numbers; no device read)
            word = self._mask_words()[rank:rank + 1]
            word.copy_(torch.where(word != 0, word, torch.full_like(word, int(F.LL_MASK_HAND))))

    def _unmask_across_hosts(self, ranks) -> None:
        """Unmask ``ranks`` with a Buffer whose ranks span hosts: a collective (every rank makes the same call).
        The group meets as after an error (:meth:`NetLeg.resync`): pending hooks are dropped, and each pair of
        ranks of which one had masked the other, one of them in ``ranks``, renumbers its rings and unmasks the
        other. Same-host ranks in ``ranks`` reached through the shared buffer are unmasked here only.

        Raises:
            ValueError: the ranks made different unmask calls (on every rank; nothing changed).
            EPTimeoutError: a rank did not come within ``timeout_s`` (nothing changed: the masks stay; that rank
                can take part in no later meeting of this Buffer), or a later step ran out of time (the Buffer
                is then unusable).
        """
        rt = self.rt
        self.start()
        comm = rt.live()
        rt.wait_comm_stream()
        comm.sync_device()
        try:
            self.net.resync(self, unmask=ranks)
        except ValueError:
            raise                           # every rank raises it; nothing was changed
        except Exception as ex:
            if not getattr(ex, "_ep_nothing_changed", False):
                comm.broken = comm.broken or f"unmasking failed: {type(ex).__name__}: {ex}"
            raise
        local = [r for r in ranks if r not in self.net.remote_ranks]
        if local:       # (the meeting restarted the call numbers already)
            self._unmask_here(local)

    def query_mask(self, status: Tensor) -> None:
        """``Buffer.low_latency_query_mask_buffer``."""
        self._masking()
        R = self.rt.group_size
        if not isinstance(status, torch.Tensor) or status.dtype != torch.int32 or tuple(status.shape) != (R,):
            raise ValueError(f"mask_status must be an int32 tensor [{R}], got "
                             f"{getattr(status, 'dtype', type(status).__name__)} {list(getattr(status, 'shape', []))}")
        with torch.inference_mode():
            # (a peer that gave up on this rank is masked by this rank's next wait for it: shown already)
            status.copy_(((self._mask_words() != 0) | (self._gaveup_words() != 0)).to(torch.int32))

    def clean_mask(self) -> None:
        """``Buffer.low_latency_clean_mask_buffer``."""
        self._masking()
        if self.net is not None:            # a collective across hosts: every rank unmasks every rank
            self._unmask_across_hosts(list(range(self.rt.group_size)))
        self._unmask_here(range(self.rt.group_size))

    def clean(self, n_max: int, hidden: int, num_experts: int) -> None:
        """``Buffer.clean_low_latency_buffer``."""
        self.rt.live()
        if not all(isint(v) and v > 0 for v in (n_max, hidden, num_experts)):
            raise ValueError(f"clean_low_latency_buffer takes positive ints (num_max_dispatch_tokens_per_rank, "
                             f"hidden, num_experts), got {(n_max, hidden, num_experts)!r}")
        self.rt.check_num_experts(num_experts)
        self.layout(n_max, hidden, num_experts)
        self.start()


class Unavailable:
    """The low-latency mode of a Buffer built without one (no ``low_latency_mode``, no ``num_rdma_bytes`` or no
    process group): every low-latency call raises ``ValueError`` (``EPError`` once the Buffer was destroyed)."""

    net = None

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def _refuse(self, *args, **kwargs):
        self.rt.live()
        raise ValueError("low-latency calls need Buffer(..., num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint"
                         "(...), low_latency_mode=True) built over a process group")

    dispatch = combine = next_combine_buffer = clean = update_mask = query_mask = clean_mask = _refuse

    def close(self) -> None:
        """Release what this mode holds of its own: nothing (no low-latency mode)."""

    def check(self) -> None:
        """Nothing of its own to raise."""
