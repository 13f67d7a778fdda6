"""Low-latency mode's calls (:class:`LowLatency`, the Buffer's low-latency mode over its
:class:`~.state.LowLatencyState`): a dispatch's and a combine's general path: check the arguments, number and
publish the call, allocate the outputs, launch (send and receive, one launch, or a send and a receive hook), and
leave the plan the next call of the same sizes replays (:mod:`.replay`, tried first). ``ll`` is the Buffer's
:class:`LowLatency`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...config import EventOverlap
from ...errors import EPRemoteError
from ...kernels import pdl
from ...kernels.geometry import fused_switch
from ...kernels.fp8 import native_cast
from ...kernels.ll_combine import ll_combine_reduce, ll_combine_send
from ...kernels.ll_dispatch import ll_dispatch_recv, ll_dispatch_send, ll_route
from ...kernels.ll_fence import ll_fence
from ...kernels.ll_fused import ll_combine_fused, ll_dispatch_fused
from ...kernels.ll_net import ll_unpack
from ...protocol import call_card as card
from ...protocol.ll_area import Layout
from ...runtime import call_signature
from ...runtime.checks import check_tensor, isint
from . import replay
from .handle import LLHandle, carve
from .state import LowLatencyState

Tensor = torch.Tensor


@dataclass
class DispatchArgs:
    """A low-latency dispatch's checked arguments."""
    x: Tensor                   # bf16 [T, H]
    topk_idx: Tensor            # int64 or int32 [T, K]
    lay: Layout                 # the area's layout for (N, H, E)
    stats: Optional[Tensor]     # int32 [E_local]: rows received per local expert are added to it
    cost: Optional[Tensor]      # int64 [R]: this rank's wait per source rank, nanoseconds
    fence: bool                 # wait first until every peer received the last call (of other sizes)
    one: bool                   # the whole call as one launch


@dataclass
class DispatchOutputs:
    """A dispatch's fresh outputs and tables, and the routing's scratch (one allocation: :func:`carve`)."""
    recv_x: Tensor              # [E_local, R*N, H]: fp8 e4m3, or bf16
    scales: Optional[Tensor]    # fp32 [E_local, R*N, H/128] or UE8M0 int32 [.., H/512], column-major; None: bf16
    layout_range: Tensor        # int64 [E_local, R]: begin << 32 | count per source rank
    recv_count: Tensor          # int32 [E_local]
    src_info: Tensor            # int32 [E_local, R*N]: source token of each received row
    ret_slot: Tensor            # int32 [E_local, R*N]: where combine returns each row
    slots: Tensor               # int32 [T, K]: the routing's scratch
    counts: Tensor              # int32 [E]: the routing's scratch
    parts: tuple                # ((dtype, shape), ...) of the carved tables, as carve takes them


@dataclass
class CombineArgs:
    """A low-latency combine's checked arguments."""
    x: Tensor                   # bf16 [E_local, R*N, H] (with zero_copy: the zero-copy buffer)
    topk_idx: Tensor            # int64 or int32 [T, K]
    weights: Tensor             # fp32 [T, K]
    handle: LLHandle            # the matching dispatch's
    lay: Layout                 # the area's layout for the handle's sizes
    out: Optional[Tensor]       # bf16 [T, H] given by the caller, or None
    cost: Optional[Tensor]      # int64 [R]: this rank's wait per source rank, nanoseconds
    fence: bool                 # wait first until every peer received the last call (of other sizes)
    one: bool                   # the whole call as one launch
    use_logfmt: bool            # the rows travel as LogFMT-10


class LowLatency(LowLatencyState):
    """Low-latency mode of one Buffer (what :class:`~triton_ep.Buffer` delegates its ``low_latency_*`` methods to):
    its calls over its :class:`~.state.LowLatencyState` (the area, call numbers, errors, masking). The rows of a
    call come in here and go from here to the kernels' launchers.

    Args:
        rt, offset, area_bytes, shrink: as :class:`~.state.LowLatencyState`'s.
    """

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=True,
                 round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False):
        """``Buffer.low_latency_dispatch``: :func:`dispatch`."""
        self.rt.live()
        try:
            return dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                            use_ue8m0, async_finish, return_recv_hook)
        except BaseException as e:
            self.failed_mid_call(e)
            raise

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
                return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        """``Buffer.low_latency_combine``: :func:`combine`."""
        self.rt.live()
        try:
            return combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                           return_recv_hook, out, combine_wait_recv_cost_stats)
        except BaseException as e:
            self.failed_mid_call(e)
            raise

    def failed_mid_call(self, e: BaseException) -> None:
        """A low-latency call (or receive hook) of this rank raises ``e``. Within one host, unless every rank
        raises it alike (a recorded error, ``_ep_collective``) or this rank refused its arguments and told its peers
        (:meth:`guard`, ``_ep_told``): ``e`` is this rank's own failure (an interrupt, out of memory, a failed
        launch), after which it can no longer keep step with its peers, so it leaves the group as a normal-mode call
        does (``Runtime.broke_mid_call``): its peers' waits for it end at once with ``EPRemoteError`` naming it, and
        its own next call raises ``EPError``. (Across hosts the network leg's probes and the proxy's failure tell the
        peers; a call there marks the Buffer unusable after such errors itself.)"""
        if self.net is None and not getattr(e, "_ep_told", False):
            self.rt.broke_mid_call(e)

    def guard(self, fn, *args):
        """Run argument checks; on failure tell the peers (their waits for this rank end at once with
        ``EPRemoteError``) and raise (the Buffer stays usable: the next call re-synchronises the group)."""
        try:
            return fn(*args)
        except Exception as e:
            self.post_failure()
            e._ep_told = True
            raise

    def refuse(self, err: Exception) -> None:
        """Refuse a low-latency call this rank cannot serve (``err``, e.g. ``NotImplementedError`` for an engine
        fork's keyword argument) as a call whose arguments fail their checks: count it, start it as every call
        starts (a recorded error, the re-synchronisation after one), then tell the peers (their waits of the call
        end at once with ``EPRemoteError``; the next call re-synchronises the group) and raise ``err``."""
        self.rt.live()
        try:
            self.rt.count_call(low_latency=True)
            self.start()
            self.guard(_raise, err)
        except BaseException as e:
            self.failed_mid_call(e)
            raise

    def check_arg(self, name, t, dtypes, shape, why=""):
        """:func:`~triton_ep.runtime.checks.check_tensor` of an argument on this Buffer's device."""
        return check_tensor(name, t, dtypes, shape, self.rt.device, why)

    def launch(self, hook: bool, async_finish: bool, body: Callable, tensors) -> EventOverlap:
        """Run ``body`` as ``Buffer`` calls run their kernels: on the communication stream with
        ``async_finish``, else on the caller's stream (always with a hook, as DeepEP: ``async_finish``
        and ``return_recv_hook`` exclude each other), and hand the results back."""
        rt = self.rt
        rt.begin(None, async_finish and not hook)
        with rt.comm_ctx(), rt.sig.watch():
            body()
        return rt.end(async_finish and not hook, tensors)

    def send_recv(self, one: bool, send: Callable, recv: Callable) -> None:
        """The launches of a call without a receive hook: with ``one`` the whole call as one launch
        (``send(whole=True)``), else the send and then the receive, back to back (within one host the send has no
        end-of-launch count: the receive publishes the call)."""
        if one:
            send(whole=True)
            return
        defer = self.net is None
        send(defer)
        recv(0, defer)

    def hook(self, idx: int, recv: Callable) -> Callable[[], None]:
        """The receive hook of send ``idx``: runs ``recv`` once, after the error checks."""
        done = []

        def hook() -> None:
            """Complete the receive of this low-latency call (once). Raises what the kernels recorded."""
            self.rt.live()          # (EPError once the Buffer was destroyed: its area is gone)
            if done:
                raise ValueError("this receive hook has already run")
            if idx not in self.pending:
                raise ValueError("this receive hook belongs to a call dropped by a re-synchronisation (after an "
                                 "error, or an unmask across hosts)")
            done.append(True)
            self.pending.remove(idx)
            rt = self.rt
            self.raise_recorded()
            if rt.sig.record() is not None:
                # an error record since this call was sent (raised already) stops this rank's kernels
                # until the next call re-synchronises the group: the receive would move nothing
                raise EPRemoteError(f"rank {rt.rank}: the receive of this low-latency call cannot complete: an "
                                    f"error raised after it was sent stopped this rank's low-latency kernels until "
                                    f"the next call re-synchronises the group; its results are dropped")
            try:
                with rt.sig.watch():
                    recv(self.sent - idx)
                self.raise_recorded()
            except BaseException as e:
                self.failed_mid_call(e)
                raise
        return hook


def _raise(err: Exception):
    raise err


# ------------------------------------------------------------------ dispatch
def dispatch(ll, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=True,
             round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False):
    """``Buffer.low_latency_dispatch`` (its docstring has the contract): the plan of the last call of these
    sizes first, else the general path."""
    if not return_recv_hook and ll.replay_dispatch is not None:
        out = replay.dispatch(ll, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                              round_scale, use_ue8m0, async_finish)
        if out is not None:     # (a call of the last call's sizes again: its plan launched it)
            return out
    rt = ll.rt
    rt.count_call(low_latency=True)     # (before anything can refuse the call: the ranks' call numbers stay equal)
    ll.start()
    a = ll.guard(dispatch_args, ll, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                 use_ue8m0, async_finish, return_recv_hook)
    T, H = a.x.shape
    K = a.topk_idx.shape[1]
    N, E = a.lay.n_max, a.lay.num_experts
    sig = call_signature([card.LL_DISPATCH, N, H, E, K, int(use_fp8), int(use_ue8m0)])
    rt.publish(card.LL_DISPATCH, (N, H, E, K, int(use_fp8), int(use_ue8m0)))
    o = dispatch_outputs(rt, a, use_fp8, use_ue8m0)
    idx_n = ll.guard(ll.claim_send)      # a refused call launches nothing (its peers are told, as of bad arguments)
    ll.last_sizes = (N, H, E)
    send, recv, made = dispatch_launches(ll, a, o, sig, use_fp8, round_scale, use_ue8m0)
    handle = LLHandle((o.src_info, o.layout_range, N, H, E), rt.uid, o.ret_slot, o.recv_count, T, K, idx_n)
    out = (o.recv_x, o.scales) if use_fp8 else o.recv_x
    tensors = (a.x, a.topk_idx, o.slots, o.counts, o.recv_x, o.scales, o.recv_count, o.src_info, o.ret_slot,
               o.layout_range, a.stats, a.cost)
    if return_recv_hook:
        ll.pending.append(idx_n)
        event = ll.launch(True, False, send, tensors)
        return out, o.recv_count, handle, event, ll.hook(idx_n, recv)
    event = ll.launch(False, async_finish, lambda: ll.send_recv(a.one, send, recv), tensors)
    if made and ll.net is None and rt.group is not None:
        # the next call of these sizes and flags replays this launch (modes/low_latency/replay.py)
        key = (num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, a.stats is None,
               a.cost is None)
        ll.replay_dispatch = replay.dispatch_plan(ll, key, (N, H, E, K, int(use_fp8), int(use_ue8m0)), made[0], a, o,
                                                  dispatch_wait_recv_cost_stats)
    ll.raise_recorded()
    return out, o.recv_count, handle, event, None


def dispatch_outputs(rt, a: DispatchArgs, use_fp8: bool, use_ue8m0: bool) -> DispatchOutputs:
    """Fresh outputs (scales column-major in their last two dimensions, as DeepEP returns them) and the handle's
    tables and the routing's scratch in one allocation (each ``torch.empty`` costs host time)."""
    R, dev = rt.group_size, rt.device
    T, H = a.x.shape
    K = a.topk_idx.shape[1]
    N, E, El = a.lay.n_max, a.lay.num_experts, a.lay.experts_per_rank
    if use_fp8:
        recv_x = torch.empty((El, R * N, H), dtype=torch.float8_e4m3fn, device=dev)
        S = H // 512 if use_ue8m0 else H // 128
        # [E_local, R*N, S] with strides of [E_local, S, R*N] (one call, not an allocation and a transpose)
        sc = torch.empty_strided((El, R * N, S), (S * R * N, 1, R * N),
                                 dtype=torch.int32 if use_ue8m0 else torch.float32, device=dev)
    else:
        recv_x = torch.empty((El, R * N, H), dtype=torch.bfloat16, device=dev)
        sc = None
    parts = ((torch.int64, (El, R)), (torch.int32, (El,)), (torch.int32, (El, R * N)), (torch.int32, (El, R * N)),
             (torch.int32, (T, K)), (torch.int32, (E,)))
    return DispatchOutputs(recv_x, sc, *carve(dev, parts), parts)


def dispatch_launches(ll, a: DispatchArgs, o: DispatchOutputs, sig: int, use_fp8: bool, round_scale: bool,
                      use_ue8m0: bool):
    """A dispatch's ``send(defer, whole)`` and ``recv(offset, defer)`` launches, and the list a one-launch send
    appends its ``(launch, args)`` to."""
    rt = ll.rt
    R, K, E = rt.group_size, a.topk_idx.shape[1], a.lay.num_experts
    sa = rt.sig_args
    native = native_cast()
    made = []

    def send(defer: bool = False, whole: bool = False):
        if a.fence:
            ll_fence(ll.ctl, R, False, ll.shrink, sa, ll.net)
        if a.one:     # route and send as one launch, with ``whole`` the receive too (kernels/ll_fused.py)
            made.append(ll_dispatch_fused(a.x, a.topk_idx, o.slots, o.counts, ll.area, rt.delta_words, ll.ctl, a.lay,
                                          sig, use_fp8, round_scale, use_ue8m0, ll.shrink, sa, native,
                                          *((o.recv_x, o.scales, o.src_info, o.ret_slot, o.layout_range,
                                             o.recv_count, a.stats, a.cost) if whole else ())))
            return
        ll_route(a.topk_idx, o.slots, o.counts, ll.ctl, E, R, sa)
        ll_dispatch_send(a.x, a.topk_idx, o.slots, o.counts, ll.area, rt.delta_words, ll.ctl, a.lay, sig, use_fp8,
                         round_scale, ll.shrink, sa, native, ll.net, defer)

    def recv(offset: int, defer: bool = False):
        if ll.net is not None:
            ll_unpack(ll.area, ll.ctl, ll.net, a.lay, offset, False, use_fp8, ll.shrink, sa, a.cost, sig=sig)
        ll_dispatch_recv(ll.area, ll.ctl, a.lay, offset, K, use_fp8, use_ue8m0,
                         o.recv_x, o.scales, o.src_info, o.ret_slot, o.layout_range,
                         o.recv_count, a.stats, a.cost, sig, ll.shrink, sa, defer, ll.net)
    return send, recv, made


def dispatch_args(ll, x, topk_idx, N, E, stats, cost, use_fp8, round_scale, use_ue8m0, async_finish,
                  hook) -> DispatchArgs:
    """Check a dispatch's arguments (``ValueError``/``TypeError`` naming the argument, before any launch)."""
    rt = ll.rt
    pdl.check(rt.device)
    if not isint(N):
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be an int, got {type(N).__name__}")
    if N <= 0:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got {N!r}")
    rt.check_num_experts(E)
    xv = ll.check_arg("x", x, (torch.bfloat16,), (None, None))
    T, H = xv.shape
    if H % 8 or H == 0:      # (rows move as 16-byte vectors)
        raise ValueError(f"low-latency x needs rows of a multiple of 16 bytes (bf16: hidden % 8 == 0), got hidden "
                         f"{H}")
    if use_fp8 and H % 128:
        raise ValueError(f"use_fp8=True casts x in blocks of 128 channels with one scale each: hidden must be a "
                         f"multiple of 128, got hidden {H} (use_fp8=False takes it)")
    if T > N:
        raise ValueError(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank={N}")
    idx = ll.check_arg("topk_idx", topk_idx, (torch.int64, torch.int32), (T, None), f"T = {T} rows of x")
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
    lay = ll.layout(int(N), H, int(E))
    ll.fits_network(lay, idx.shape[1])
    stats = ll.stats_arg("cumulative_local_expert_recv_stats", stats, torch.int32, [(lay.experts_per_rank,)])
    return DispatchArgs(xv, idx, lay, stats, ll.cost_arg("dispatch_wait_recv_cost_stats", cost), ll.fence(lay),
                        ll.one_launch(T))


# ------------------------------------------------------------------ combine
def combine(ll, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
            return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
    """``Buffer.low_latency_combine`` (its docstring has the contract): the plan of the last call of these
    sizes first, else the general path."""
    if (not return_recv_hook and not zero_copy and not use_logfmt and out is None
            and ll.replay_combine is not None):
        res = replay.combine(ll, x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats, async_finish)
        if res is not None:     # (a call of the last call's sizes again: its plan launched it)
            return res
    plan_out = out is None
    rt = ll.rt
    rt.count_call(low_latency=True)     # (before anything can refuse the call: the ranks' call numbers stay equal)
    ll.start()
    a = ll.guard(combine_args, ll, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                 return_recv_hook, out, combine_wait_recv_cost_stats)
    T, K = a.topk_idx.shape
    lay, H = a.lay, a.lay.hidden
    sig = call_signature([card.LL_COMBINE, lay.n_max, H, lay.num_experts, K, int(a.use_logfmt)])
    rt.publish(card.LL_COMBINE, (lay.n_max, H, lay.num_experts, K, int(a.use_logfmt)))
    if a.out is None:
        a.out = torch.empty((T, H), dtype=torch.bfloat16, device=rt.device)
    idx_n = ll.guard(ll.claim_send)      # a refused call launches nothing (its peers are told, as of bad arguments)
    ll.last_sizes = (lay.n_max, H, lay.num_experts)
    send, recv, made = combine_launches(ll, a, sig)
    h = a.handle
    tensors = (a.x, a.topk_idx, a.weights, h.ret_slot, h.recv_count, a.out, a.cost)
    if return_recv_hook:
        ll.pending.append(idx_n)
        event = ll.launch(True, False, send, tensors)
        return a.out, event, ll.hook(idx_n, recv)
    event = ll.launch(False, async_finish, lambda: ll.send_recv(a.one, send, recv), tensors)
    if made and plan_out and not zero_copy and not a.use_logfmt and ll.net is None and rt.group is not None:
        # the next call of these sizes replays this launch (modes/low_latency/replay.py)
        ll.replay_combine = replay.combine_plan(ll, made[0], a, combine_wait_recv_cost_stats)
    ll.raise_recorded()
    return a.out, event, None


def combine_launches(ll, a: CombineArgs, sig: int):
    """A combine's ``send(defer, whole)`` and ``recv(offset, defer)`` launches, and the list a one-launch call
    appends its ``(launch, args)`` to."""
    rt = ll.rt
    h, K, sa = a.handle, a.topk_idx.shape[1], rt.sig_args
    made = []

    def send(defer: bool = False, whole: bool = False):
        if a.fence:
            ll_fence(ll.ctl, rt.group_size, True, ll.shrink, sa, ll.net)
        if whole:   # send and reduce as one launch (kernels/ll_fused.py)
            made.append(ll_combine_fused(a.x, h.ret_slot, h.recv_count, h.layout_range, a.topk_idx, a.weights, a.out,
                                         a.cost, ll.area, rt.delta_words, ll.ctl, a.lay, sig, ll.shrink, sa,
                                         a.use_logfmt))
            return
        ll_combine_send(a.x, h.ret_slot, h.recv_count, h.layout_range, K, ll.area, rt.delta_words, ll.ctl, a.lay,
                        sig, ll.shrink, sa, ll.net, defer, a.use_logfmt)

    def recv(offset: int, defer: bool = False):
        if ll.net is not None:
            ll_unpack(ll.area, ll.ctl, ll.net, a.lay, offset, True, False, ll.shrink, sa, a.cost, a.use_logfmt,
                      sig)
        ll_combine_reduce(ll.area, ll.ctl, a.topk_idx, a.weights, a.out, a.cost, offset, a.lay, sig, ll.shrink, sa,
                          defer, a.use_logfmt, ll.net)
    return send, recv, made


def combine_args(ll, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, hook, out,
                 cost) -> CombineArgs:
    """Check a combine's arguments (``ValueError``/``TypeError`` naming the argument, before any launch)."""
    rt = ll.rt
    if not isinstance(use_logfmt, (bool, int)) or use_logfmt not in (0, 1):
        raise TypeError(f"use_logfmt must be a bool, got {use_logfmt!r}")
    use_logfmt = bool(use_logfmt)
    if use_logfmt and zero_copy:
        # as DeepEP, whose combine asserts not (zero_copy and use_logfmt): its zero-copy rows sit in the send
        # buffer as bf16 and go out as they are
        raise ValueError("use_logfmt=True cannot be combined with zero_copy=True (as in DeepEP): pass the expert "
                         "outputs as x")
    h = ll.check_handle(handle)
    if h.call in ll.pending:
        raise ValueError("the handle's low_latency_dispatch still waits for its receive: call the hook it "
                         "returned before low_latency_combine (the handle's tables are written there)")
    R = rt.group_size
    N, H, E = h.sizes
    if use_logfmt and H % 128:
        # LogFMT codes whole blocks of 128 channels (DeepEP's), each with its own scale words
        raise ValueError(f"use_logfmt=True codes rows in blocks of 128 channels: hidden must be a multiple of "
                         f"128, got hidden {H} (use_logfmt=False takes it)")
    lay = ll.layout(N, H, E)
    xv = ll.check_arg("x", x, (torch.bfloat16,), (lay.experts_per_rank, R * N, H),
                      f"the handle's dispatch: E/R = {lay.experts_per_rank}, R*N = {R * N}, hidden {H}")
    if zero_copy:
        # DeepEP's contract: the caller wrote the expert outputs into the zero-copy buffer; what that
        # buffer holds is sent, and x only has to have its shape and dtype (DeepEP's own programs pass
        # the tensor they copied from)
        xv = ll.zero_copy_buffer(lay)
    T = h.num_tokens
    why = f"the handle's dispatch took {T} tokens and {h.num_topk} top-k columns"
    idx = ll.check_arg("topk_idx", topk_idx, (torch.int64, torch.int32), (T, h.num_topk), why)
    ll.fits_network(lay, h.num_topk)
    w = ll.check_arg("topk_weights", topk_weights, (torch.float32,), (T, h.num_topk), why)
    _check_out(out, T, H, rt.device)
    if async_finish and hook:
        raise ValueError("async_finish and return_recv_hook cannot both be set (as in DeepEP)")
    return CombineArgs(xv, idx, w, h, lay, out, ll.cost_arg("combine_wait_recv_cost_stats", cost), ll.fence(lay),
                       ll.one_launch(T), use_logfmt)


def _check_out(out: Optional[Tensor], T: int, H: int, device) -> None:
    """``out`` is ``None`` or a contiguous bf16 ``[T, H]`` on ``device`` (``TypeError`` for no tensor or another
    dtype, as DeepEP's other dtype errors; ``ValueError`` for a shape, layout or device)."""
    if out is not None:
        bad_type = not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
        if bad_type or tuple(out.shape) != (T, H) or not out.is_contiguous() or out.device != device:
            err = TypeError if bad_type else ValueError
            layout = "non-contiguous " if isinstance(out, torch.Tensor) and not out.is_contiguous() else ""
            raise err(f"out must be a contiguous bf16 tensor [{T}, {H}] on {device} (the handle's tokens, hidden), "
                      f"got a {layout}{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))} "
                      f"on {getattr(out, 'device', '-')}")

