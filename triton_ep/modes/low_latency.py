"""Low-latency mode (DeepEP's decode-time dispatch and combine), within one host and, with the network leg of
:mod:`triton_ep.modes.internode_ll`, across hosts.

:class:`LowLatency` is what :class:`~triton_ep.Buffer` delegates its ``low_latency_*`` methods to. It
owns the low-latency area: the part of each rank's shared buffer sized by ``num_rdma_bytes``, mapped by
every rank (CUDA IPC on GPU, POSIX shared memory on CPU), laid out by :class:`Layout`::

    [ control block | half 0 | half 1 | zero-copy combine input ]

Every low-latency call (a dispatch or a combine) is numbered on the device (the control block's
``L_SEQ``, advanced by the kernels, so a CUDA graph replays it correctly) and uses half ``n & 1``. Each
call is a *send* launch then a *receive* launch (:mod:`triton_ep.kernels.ll_dispatch`,
:mod:`triton_ep.kernels.ll_combine`); with ``return_recv_hook`` the receive launch is what the hook
runs. No call waits on the host, reads the device or synchronises a stream: every wait is a bounded
device wait that writes an error record, raised by :meth:`Buffer.check` (which every call runs first).
"""
from __future__ import annotations

import weakref
from typing import Callable, List, Optional

import torch

from ..config import EventOverlap
from ..errors import EPError, EPRemoteError
from ..kernels import flags as F, logfmt, pdl
from ..kernels.dispatch import fused_switch, use_fused
from ..kernels.fp8 import native_cast
from ..kernels.ll_combine import ll_combine_reduce, ll_combine_send
from ..kernels.ll_dispatch import ll_dispatch_recv, ll_dispatch_send, ll_route
from ..kernels.ll_fence import ll_fence
from ..kernels.ll_fused import ll_combine_fused, ll_dispatch_fused
from ..kernels.ll_net import ll_unpack
from ..protocol import call_card as card
from ..protocol.ll_area import Layout
from ..protocol.signal_header import failure_word_of
from ..runtime import Runtime
from ..runtime.checks import isint
from ..transport import signals
from ..transport.ipc import SLOT_HEADER
from . import low_latency_replay as replay

Tensor = torch.Tensor


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the low-latency area for these sizes (:class:`Layout`), rounded up to 128 bytes as DeepEP's."""
    n = Layout(int(num_ranks), int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts)).total_bytes
    return (n + 127) // 128 * 128


def carve(device: torch.device, parts) -> List[Tensor]:
    """Uninitialised tensors ``[(dtype, shape), ...]`` on ``device`` (``parts``: a tuple of such pairs), views
    of one allocation, each starting on a 16-byte boundary (what Triton specialises pointers on). They share
    one storage: it lives until the last of them is freed. The offsets of each ``parts`` are worked out once;
    a call makes one allocation, a view of it per dtype and a strided view per part."""
    plan = _CARVE_PLANS.get(parts)
    if plan is None:
        plan = _carve_plan(parts)
        if len(_CARVE_PLANS) >= 256:
            _CARVE_PLANS.clear()
        _CARVE_PLANS[parts] = plan
    nbytes, dtypes, views = plan
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    typed = {dt: raw.view(dt) for dt in dtypes}
    return [typed[dt].as_strided(shape, stride, off) for dt, shape, stride, off in views]


def _carve_plan(parts) -> tuple:
    """``carve``'s layout of ``parts``: total bytes (a multiple of 16), the dtypes, and per part its dtype,
    shape, contiguous strides and offset in elements of its dtype."""
    views, at = [], 0
    for dtype, shape in parts:
        stride, n = [], 1
        for d in reversed(shape):
            stride.append(n)
            n *= d
        views.append((dtype, tuple(shape), tuple(reversed(stride)), at // dtype.itemsize))
        at += (dtype.itemsize * n + 15) // 16 * 16
    return max(at, 16), tuple(dict.fromkeys(dt for dt, _ in parts)), tuple(views)


#: ``carve``'s plans, by ``parts``
_CARVE_PLANS: dict = {}


class LLHandle(tuple):
    """DeepEP's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``:

    - ``src_info`` int32 ``[E_local, R*N]``: the source token index of each received row (``-1`` past
      the expert's count);
    - ``layout_range`` int64 ``[E_local, R]``: ``begin << 32 | count`` of each source rank's rows.

    It also keeps ``ret_slot`` (int32 ``[E_local, R*N]``: where combine returns each row), ``recv_count``,
    ``num_topk``, ``num_tokens``, the Buffer that made it and ``call``, the host's number of the send that
    made it (its tables are written by that call's receive: a combine before the receive hook ran is refused).
    """

    def __new__(cls, items, buffer_uid: str, ret_slot: Tensor, recv_count: Tensor, num_tokens: int, num_topk: int,
                call: int = 0):
        self = super().__new__(cls, items)
        self.buffer_uid, self.ret_slot, self.recv_count = buffer_uid, ret_slot, recv_count
        self.num_tokens, self.num_topk, self.call = num_tokens, num_topk, call
        return self


#: the stages of low-latency kernels' error records (a record of one asks for a restart of the call numbers)
_LL_STAGES = frozenset(int(st) for st in (F.STAGE_LL_DISPATCH_SEND, F.STAGE_LL_DISPATCH_RECV, F.STAGE_LL_COMBINE_SEND,
                                          F.STAGE_LL_COMBINE_RECV))


class LowLatency:
    """The low-latency state of one Buffer: its area (``area_bytes`` at byte ``offset`` of the Buffer's
    data buffer, the same offset on every rank), hooks still to run, and the host count of sends."""

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
        #: ranks on several hosts: the network leg to every other rank (:mod:`triton_ep.modes.internode_ll`)
        self.net = None
        #: the plans the next dispatch and combine of the same sizes replay (:mod:`.low_latency_replay`)
        self.replay_dispatch = self.replay_combine = None
        self._layouts: dict = {}
        #: this rank failed a low-latency call since the last restart of the call numbers (see resync_fill)
        self.failed = False
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

    def _fits_network(self, lay: Layout, num_topk: int) -> None:
        """Across hosts: a call's largest chunk must fit a ring slot (it does with the size hint)."""
        if self.net is not None and lay.net_chunk_bytes(num_topk) > self.net.slot_bytes:
            raise ValueError(f"num_rdma_bytes={self.area_bytes} gives the network leg ring slots of "
                             f"{self.net.slot_bytes} bytes, but a call with num_max_dispatch_tokens_per_rank="
                             f"{lay.n_max}, hidden={lay.hidden}, num_experts={lay.num_experts} and top-{num_topk} may "
                             f"send a peer {lay.net_chunk_bytes(num_topk)}; build the Buffer with num_rdma_bytes >= "
                             f"Buffer.get_low_latency_rdma_size_hint(...)")

    def _start(self) -> None:
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
        a low-latency call's error, or a peer's failure word waits in its control block). A small device read:
        an error path."""
        if self.net is not None:        # (across hosts the network leg re-synchronises low-latency calls)
            return
        R = self.rt.group_size
        failed_words = self.ctl[F.off_ll_failed.host(R):F.off_ll_failed.host(R) + R]
        rec = self.rt.sig.record()
        recorded = rec is not None and rec.stage in _LL_STAGES
        slot[SLOT_HEADER] = int(self.ctl[int(F.L_SEQ)].item())
        slot[SLOT_HEADER + 1] = int(self.failed or recorded or bool(failed_words.any().item()))

    def resync_apply(self, slots) -> None:
        """After a re-synchronisation meeting: where any rank failed a low-latency call, holds a peer's failure
        word or sent another number of calls, or the meeting is a low-latency call's, every rank restarts its
        low-latency call numbers above the highest any rank reached (hooks still pending are dropped); otherwise
        (a normal-mode call's meeting after a normal-mode error) nothing changes, and a pending hook still
        receives."""
        if self.net is not None:
            return
        seqs = [int(s[SLOT_HEADER]) for s in slots]
        if len(set(seqs)) == 1 and not any(int(s[SLOT_HEADER + 1]) for s in slots):
            return
        top = max(seqs)
        R = self.rt.group_size
        with torch.inference_mode():
            # L_SEQ, L_DONE, CONS[0..1]; PEND[0..1] as CONS (nothing left to release)
            self.ctl[:4].copy_(torch.tensor([top, 0, top, top], dtype=torch.int64, device=self.ctl.device))
            self.ctl[int(F.L_PEND):int(F.L_PEND) + 2].fill_(top)
            self.ctl[int(F.L_DONE2)] = 0        # (a one-launch call's gate counter; GATE itself only grows)
            # failure words name calls up to top + 1: none may match a call after the restart (the peers
            # wrote them before they came to this meeting)
            self.ctl[F.off_ll_failed.host(R):F.off_ll_failed.host(R) + R].fill_(0)
        self.pending.clear()
        self.failed = False

    def _guard(self, fn, *args):
        """Run argument checks; on failure tell the peers (their waits for this rank end at once with
        ``EPRemoteError``) and raise."""
        try:
            return fn(*args)
        except Exception:
            self._post_failure()
            raise

    def _post_failure(self) -> None:
        """This rank rejects its next low-latency call: write that call's number into every peer's
        ``LFAILED[rank]``, so their waits of that call end at once (their earlier calls, which may still
        be running, are not affected), and mark this rank for re-synchronisation (its own kernels go on:
        a hook of an earlier call still receives)."""
        rt = self.rt
        R, me = rt.group_size, rt.rank
        rt.wait_comm_stream()
        n = int(self.ctl[int(F.L_SEQ)].item()) + 1       # a device read: an error path
        with torch.inference_mode():
            for r, pc in enumerate(self.peer_ctl):
                if r != me:
                    pc[F.off_ll_failed.host(R) + me].fill_(failure_word_of(n, F.E_FAILED))
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

    def _one_launch(self, num_tokens: int) -> bool:
        """Whether a call of ``num_tokens`` tokens runs as one launch (:mod:`triton_ep.kernels.ll_fused`; with a
        receive hook, a dispatch's route and send as one): within one host (no network leg), as normal mode's
        calls of one round (:func:`triton_ep.kernels.dispatch.use_fused`: real ranks, up to the tuning table's
        ``fused`` token limit; ``TRITON_EP_FUSED`` forces it on or off), and not while the stream is captured into a
        CUDA graph unless forced. Raises ``ValueError`` for a bad ``TRITON_EP_FUSED``."""
        force = fused_switch()
        if self.net is not None:
            return False
        if force is None and self.rt.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False        # (in a CUDA graph host time does not count, and the split launches take less GPU time)
        return use_fused(num_tokens, self.rt.group, force)

    def _fence(self, lay: Layout) -> bool:
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

    def _claim_send(self) -> int:
        """Host bookkeeping of a new send: call ``n`` reuses the half of call ``n - 2``, which must have been
        received here (at most two calls outstanding)."""
        if any(p <= self.sent - 1 for p in self.pending):
            raise ValueError("at most two low-latency calls may be outstanding, and the one before the last still "
                             "waits for its receive: call that call's hook first")
        self.sent += 1
        return self.sent

    def _check(self, name, t, dtypes, shape, why=""):
        return self.rt.check_tensor(name, t, dtypes, shape, why)

    def _stats(self, name: str, t: Optional[Tensor], dtype, shapes) -> Optional[Tensor]:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) not in shapes or not t.is_contiguous() or t.device != self.rt.device:
            raise ValueError(f"{name} must be a contiguous tensor of shape {' or '.join(map(str, shapes))} on "
                             f"{self.rt.device}, got {tuple(t.shape)} on {t.device}")
        return t

    def _cost(self, name: str, t: Optional[Tensor]) -> Optional[Tensor]:
        R = self.rt.group_size
        t = self._stats(name, t, torch.int64, [(R,), (R, R)])
        if t is not None and t.dim() == 2:       # this rank's row: waits for each source rank
            t = t[self.rt.rank]
        return t

    def _launch(self, hook: bool, async_finish: bool, body: Callable, tensors) -> EventOverlap:
        """Run ``body`` as ``Buffer`` calls run their kernels: on the communication stream with
        ``async_finish``, else on the caller's stream (always with a hook, as DeepEP: ``async_finish``
        and ``return_recv_hook`` exclude each other), and hand the results back."""
        rt = self.rt
        rt.begin(None, async_finish and not hook)
        with rt.comm_ctx(), rt.sig.watch():
            body()
        return rt.end(async_finish and not hook, tensors)

    def _send_recv(self, one: bool, send: Callable, recv: Callable) -> None:
        """The launches of a call without a receive hook: with ``one`` the whole call as one launch
        (``send(whole=True)``), else the send and then the receive, back to back (within one host the send has no
        end-of-launch count: the receive publishes the call)."""
        if one:
            send(whole=True)
            return
        defer = self.net is None
        send(defer)
        recv(0, defer)

    def _hook(self, idx: int, recv: Callable) -> Callable[[], None]:
        done = []

        def hook() -> None:
            """Complete the receive of this low-latency call (once). Raises what the kernels recorded."""
            if done:
                raise ValueError("this receive hook has already run")
            if idx not in self.pending:
                raise ValueError("this receive hook belongs to a call dropped by a re-synchronisation (after an "
                                 "error, or an unmask across hosts)")
            done.append(True)
            self.pending.remove(idx)
            rt = self.rt
            rt.check()
            if rt.sig.record() is not None:
                # an error record since this call was sent (raised already) stops this rank's kernels
                # until the next call re-synchronises the group: the receive would move nothing
                raise EPRemoteError(f"rank {rt.rank}: the receive of this low-latency call cannot complete: an "
                                    f"error raised after it was sent stopped this rank's low-latency kernels until "
                                    f"the next call re-synchronises the group; its results are dropped")
            with rt.sig.watch():
                recv(self.sent - idx)
            rt.check()
        return hook

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=True,
                 round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False):
        if not return_recv_hook and self.replay_dispatch is not None:
            out = replay.dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                  cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                  round_scale, use_ue8m0, async_finish)
            if out is not None:     # (a call of the last call's sizes again: its plan launched it)
                return out
        self._start()
        rt = self.rt
        R = rt.group_size
        a = self._guard(self._dispatch_args, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                        use_ue8m0, async_finish, return_recv_hook)
        xv, idx, lay, stats, cost, fence, one = a
        T, H = xv.shape
        K = idx.shape[1]
        N, E, El = lay.n_max, lay.num_experts, lay.experts_per_rank
        dev = rt.device
        sig = signals.call_signature([card.LL_DISPATCH, N, H, E, K, int(use_fp8), int(use_ue8m0)])
        rt.count_call()
        rt.publish(card.LL_DISPATCH, (N, H, E, K, int(use_fp8), int(use_ue8m0)))
        # fresh outputs (scales column-major in their last two dimensions, as DeepEP returns them)
        if use_fp8:
            recv_x = torch.empty((El, R * N, H), dtype=torch.float8_e4m3fn, device=dev)
            S = H // 512 if use_ue8m0 else H // 128
            # [E_local, R*N, S] with strides of [E_local, S, R*N] (one call, not an allocation and a transpose)
            sc = recv_scales = torch.empty_strided((El, R * N, S), (S * R * N, 1, R * N),
                                                   dtype=torch.int32 if use_ue8m0 else torch.float32, device=dev)
        else:
            recv_x = torch.empty((El, R * N, H), dtype=torch.bfloat16, device=dev)
            sc = recv_scales = None
        # the handle's tables and the routing's scratch: one allocation (each torch.empty costs host time)
        parts = ((torch.int64, (El, R)), (torch.int32, (El,)), (torch.int32, (El, R * N)), (torch.int32, (El, R * N)),
                 (torch.int32, (T, K)), (torch.int32, (E,)))
        layout_range, recv_count, src_info, ret_slot, slots, counts = carve(dev, parts)
        sa = rt.sig_args
        native = native_cast()
        idx_n = self._claim_send()      # a refused call launches nothing (every rank makes the same calls)
        self.last_sizes = (N, H, E)
        made = []

        def send(defer: bool = False, whole: bool = False):
            if fence:
                ll_fence(self.ctl, R, False, self.shrink, sa)
            if one:     # route and send as one launch, with ``whole`` the receive too (kernels/ll_fused.py)
                made.append(ll_dispatch_fused(xv, idx, slots, counts, self.area, rt.delta_words, self.ctl, lay, sig,
                                              use_fp8, round_scale, use_ue8m0, self.shrink, sa, native,
                                              *((recv_x, sc, src_info, ret_slot, layout_range, recv_count, stats, cost)
                                                if whole else ())))
                return
            ll_route(idx, slots, counts, self.ctl, E, R, sa)
            ll_dispatch_send(xv, idx, slots, counts, self.area, rt.delta_words, self.ctl, lay, sig, use_fp8,
                             round_scale, self.shrink, sa, native, self.net, defer)

        def recv(offset: int, defer: bool = False):
            if self.net is not None:
                ll_unpack(self.area, self.ctl, self.net, lay, offset, False, use_fp8, self.shrink, sa, cost, sig=sig)
            ll_dispatch_recv(self.area, self.ctl, lay, offset, K, use_fp8, use_ue8m0,
                             recv_x, sc, src_info, ret_slot, layout_range,
                             recv_count, stats, cost, sig, self.shrink, sa, defer)

        handle = LLHandle((src_info, layout_range, N, H, E), rt.uid, ret_slot, recv_count, T, K, idx_n)
        out = (recv_x, recv_scales) if use_fp8 else recv_x
        tensors = (xv, idx, slots, counts, recv_x, sc, recv_count, src_info, ret_slot, layout_range, stats, cost)
        if return_recv_hook:
            self.pending.append(idx_n)
            event = self._launch(True, False, send, tensors)
            return out, recv_count, handle, event, self._hook(idx_n, recv)
        event = self._launch(False, async_finish, lambda: self._send_recv(one, send, recv), tensors)
        if made and self.net is None and rt.group is not None:
            # the next call of these sizes and flags replays this launch (modes/low_latency_replay.py)
            launch, args = made[0]
            vary = tuple(t for t in (xv, idx, slots, counts, recv_x, sc, src_info, ret_slot, layout_range, recv_count,
                                     stats, cost) if t is not None)
            raw_cost = dispatch_wait_recv_cost_stats
            self.replay_dispatch = replay.LLPlan(
                self, (num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, stats is None,
                       cost is None), (card.LL_DISPATCH, (N, H, E, K, int(use_fp8), int(use_ue8m0))),
                launch.replay(args, vary), fused_switch(),
                (xv.shape, idx.shape, idx.dtype, None if stats is None else stats.shape,
                 None if raw_cost is None else raw_cost.shape),
                (recv_x.shape, None if sc is None else sc.shape, None if sc is None else sc.stride(),
                 None if sc is None else sc.dtype, parts))
        rt.check()
        return out, recv_count, handle, event, None

    def _dispatch_args(self, x, topk_idx, N, E, stats, cost, use_fp8, round_scale, use_ue8m0, async_finish, hook):
        rt = self.rt
        pdl.check(rt.device)
        if not isint(N) or N <= 0:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got {N!r}")
        rt.check_num_experts(E)
        xv = self._check("x", x, (torch.bfloat16,), (None, None))
        T, H = xv.shape
        if H % 8 or H == 0:      # (rows move as 16-byte vectors)
            raise ValueError(f"low-latency x needs rows of a multiple of 16 bytes (bf16: hidden % 8 == 0), got hidden "
                             f"{H}")
        if use_fp8 and H % 128:
            raise ValueError(f"use_fp8=True casts x in blocks of 128 channels with one scale each: hidden must be a "
                             f"multiple of 128, got hidden {H} (use_fp8=False takes it)")
        if T > N:
            raise ValueError(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank={N}")
        idx = self._check("topk_idx", topk_idx, (torch.int64, torch.int32), (T, None), f"T = {T} rows of x")
        if idx.shape[1] == 0:
            raise ValueError("topk_idx must have at least one column")
        if idx.shape[1] > E:
            # combine returns N * K rows to each source in a half of the area sized for E * N records
            raise ValueError(f"topk_idx has {idx.shape[1]} columns, more than num_experts={E}")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (UE8M0 holds powers of two)")
        if use_ue8m0 and H % 512:
            raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got {H}")
        if async_finish and hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as in DeepEP)")
        lay = self.layout(int(N), H, int(E))
        self._fits_network(lay, idx.shape[1])
        stats = self._stats("cumulative_local_expert_recv_stats", stats, torch.int32, [(lay.experts_per_rank,)])
        return (xv, idx, lay, stats, self._cost("dispatch_wait_recv_cost_stats", cost), self._fence(lay),
                self._one_launch(T))

    # ------------------------------------------------------------------ combine
    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
                return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        if (not return_recv_hook and not zero_copy and not use_logfmt and out is None
                and self.replay_combine is not None):
            res = replay.combine(self, x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats, async_finish)
            if res is not None:     # (a call of the last call's sizes again: its plan launched it)
                return res
        plan_out = out is None
        self._start()
        rt = self.rt
        a = self._guard(self._combine_args, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                        return_recv_hook, out, combine_wait_recv_cost_stats)
        xv, idx, w, h, lay, out, cost, fence, one, use_logfmt = a
        T, K = idx.shape
        H = lay.hidden
        sig = signals.call_signature([card.LL_COMBINE, lay.n_max, H, lay.num_experts, K, int(use_logfmt)])
        rt.count_call()
        rt.publish(card.LL_COMBINE, (lay.n_max, H, lay.num_experts, K, int(use_logfmt)))
        if out is None:
            out = torch.empty((T, H), dtype=torch.bfloat16, device=rt.device)
        sa = rt.sig_args
        idx_n = self._claim_send()      # a refused call launches nothing (every rank makes the same calls)
        self.last_sizes = (lay.n_max, H, lay.num_experts)
        made = []

        def send(defer: bool = False, whole: bool = False):
            if fence:
                ll_fence(self.ctl, rt.group_size, True, self.shrink, sa)
            if whole:   # send and reduce as one launch (kernels/ll_fused.py)
                made.append(ll_combine_fused(xv, h.ret_slot, h.recv_count, h[1], idx, w, out, cost, self.area,
                                             rt.delta_words, self.ctl, lay, sig, self.shrink, sa, use_logfmt))
                return
            ll_combine_send(xv, h.ret_slot, h.recv_count, h[1], K, self.area, rt.delta_words, self.ctl, lay, sig,
                            self.shrink, sa, self.net, defer, use_logfmt)

        def recv(offset: int, defer: bool = False):
            if self.net is not None:
                ll_unpack(self.area, self.ctl, self.net, lay, offset, True, False, self.shrink, sa, cost, use_logfmt,
                          sig)
            ll_combine_reduce(self.area, self.ctl, idx, w, out, cost, offset, lay, sig, self.shrink, sa, defer,
                              use_logfmt)

        tensors = (xv, idx, w, h.ret_slot, h.recv_count, out, cost)
        if return_recv_hook:
            self.pending.append(idx_n)
            event = self._launch(True, False, send, tensors)
            return out, event, self._hook(idx_n, recv)
        event = self._launch(False, async_finish, lambda: self._send_recv(one, send, recv), tensors)
        if made and plan_out and not zero_copy and not use_logfmt and self.net is None and rt.group is not None:
            # the next call of these sizes replays this launch (modes/low_latency_replay.py)
            launch, args = made[0]
            vary = tuple(t for t in (xv, h.ret_slot, h.recv_count, h[1], idx, w, out, cost) if t is not None)
            raw_cost = combine_wait_recv_cost_stats
            self.replay_combine = replay.LLPlan(
                self, (cost is None,), (card.LL_COMBINE, (lay.n_max, H, lay.num_experts, K, 0)),
                launch.replay(args, vary),
                fused_switch(), (xv.shape, idx.shape, idx.dtype, None if raw_cost is None else raw_cost.shape),
                (lay.n_max, H, lay.num_experts))
        rt.check()
        return out, event, None

    def _combine_args(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, hook, out, cost):
        rt = self.rt
        if not isinstance(use_logfmt, (bool, int)) or use_logfmt not in (0, 1):
            raise TypeError(f"use_logfmt must be a bool, got {use_logfmt!r}")
        use_logfmt = bool(use_logfmt)
        if use_logfmt and zero_copy:
            # as DeepEP, whose combine asserts not (zero_copy and use_logfmt): its zero-copy rows sit in the send
            # buffer as bf16 and go out as they are
            raise ValueError("use_logfmt=True cannot be combined with zero_copy=True (as in DeepEP): pass the expert "
                             "outputs as x")
        h = self.check_handle(handle)
        if h.call in self.pending:
            raise ValueError("the handle's low_latency_dispatch still waits for its receive: call the hook it "
                             "returned before low_latency_combine (the handle's tables are written there)")
        R = rt.group_size
        N, H, E = h[2], h[3], h[4]
        if use_logfmt and H % 128:
            # LogFMT codes whole blocks of 128 channels (DeepEP's), each with its own scale words
            raise ValueError(f"use_logfmt=True codes rows in blocks of 128 channels: hidden must be a multiple of "
                             f"128, got hidden {H} (use_logfmt=False takes it)")
        lay = self.layout(N, H, E)
        xv = self._check("x", x, (torch.bfloat16,), (lay.experts_per_rank, R * N, H),
                         f"the handle's dispatch: E/R = {lay.experts_per_rank}, R*N = {R * N}, hidden {H}")
        if zero_copy:
            # DeepEP's contract: the caller wrote the expert outputs into the zero-copy buffer; what that
            # buffer holds is sent, and x only has to have its shape and dtype (DeepEP's own programs pass
            # the tensor they copied from)
            xv = self.zero_copy_buffer(lay)
        T = h.num_tokens
        why = f"the handle's dispatch took {T} tokens and {h.num_topk} top-k columns"
        idx = self._check("topk_idx", topk_idx, (torch.int64, torch.int32), (T, h.num_topk), why)
        self._fits_network(lay, h.num_topk)
        w = self._check("topk_weights", topk_weights, (torch.float32,), (T, h.num_topk), why)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (T, H) \
                    or not out.is_contiguous() or out.device != rt.device:
                raise ValueError(f"out must be a contiguous bf16 tensor [{T}, {H}] on {rt.device} (the handle's "
                                 f"tokens, hidden), got {getattr(out, 'dtype', type(out).__name__)} "
                                 f"{list(getattr(out, 'shape', []))} on {getattr(out, 'device', '-')}")
        if async_finish and hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as in DeepEP)")
        return (xv, idx, w, h, lay, out, self._cost("combine_wait_recv_cost_stats", cost), self._fence(lay),
                self._one_launch(T), use_logfmt)

    def check(self) -> None:
        """Across hosts (``Buffer.check``): raise what this mode's kernels and RDMA proxy recorded. Within one
        host the Buffer's runtime is this mode's, checked by the Buffer itself."""
        if self.net is not None:
            self.net.sched.check()
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
    def _mask_words(self) -> Tensor:
        R = self.rt.group_size
        return self.ctl[F.off_ll_mask.host(R):F.off_ll_mask.host(R) + R]

    def update_mask(self, rank: int, mask: bool) -> None:
        if not isint(rank) or not 0 <= rank < self.rt.group_size:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.rt.group_size}), got {rank!r}")
        rank = int(rank)
        if self.net is not None and not mask:   # a collective across hosts, on every rank (the rank itself too)
            self._unmask_across_hosts([rank])
            return
        if self.net is not None and rank in self.net.remote_ranks:
            self.net.sched.flags.mask(rank)     # its proxy drops what it still holds for that rank
        with torch.inference_mode():
            self._mask_words()[rank].fill_(1 if mask else 0)

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
        self._start()
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
        with torch.inference_mode():
            for r in local:
                self._mask_words()[r].fill_(0)

    def query_mask(self, status: Tensor) -> None:
        R = self.rt.group_size
        if not isinstance(status, torch.Tensor) or status.dtype != torch.int32 or tuple(status.shape) != (R,):
            raise ValueError(f"mask_status must be an int32 tensor [{R}], got "
                             f"{getattr(status, 'dtype', type(status).__name__)} {list(getattr(status, 'shape', []))}")
        with torch.inference_mode():
            status.copy_((self._mask_words() != 0).to(torch.int32))

    def clean_mask(self) -> None:
        if self.net is not None:            # a collective across hosts: every rank unmasks every rank
            self._unmask_across_hosts(list(range(self.rt.group_size)))
        with torch.inference_mode():
            self._mask_words().zero_()

    def clean(self, n_max: int, hidden: int, num_experts: int) -> None:
        if not all(isint(v) and v > 0 for v in (n_max, hidden, num_experts)):
            raise ValueError(f"clean_low_latency_buffer takes positive ints (num_max_dispatch_tokens_per_rank, "
                             f"hidden, num_experts), got {(n_max, hidden, num_experts)!r}")
        self.rt.check_num_experts(num_experts)
        self.layout(n_max, hidden, num_experts)
        self._start()
