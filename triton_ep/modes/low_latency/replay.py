"""Low-latency dispatch and combine calls made again with the sizes of the last call: the same launch, replayed.

Decode calls ``low_latency_dispatch`` and ``low_latency_combine`` every step with the same sizes and flags and only
fresh tensors. A call of one launch within one host (``LowLatency.one_launch``: no network leg, no receive
hook) leaves an :class:`LLPlan` on the Buffer's low-latency state: its sizes and flags, the call card's values,
the outputs' shapes and the launch with every argument but the call's own tensors
(:class:`triton_ep.kernels.launch.Replay`). The next call of those sizes and flags checks its tensors against the
plan (type, shape, dtype, device, contiguity, 4-byte alignment) and does what the general path does (the error
check, the call count and card, the outputs and the handle's tables, the send count, the launch, the event, the
error check) without working the rest out again. Any other call, or one that does not match its plan in any way,
takes the general path (:mod:`.calls`), which checks and raises as always and plans again.

A plan stops serving once the tuning tables changed, once the ranks re-synchronised after an error, for another
value of ``TRITON_EP_FUSED``, while a CUDA graph is being captured (the general path then takes the split
launches), while a receive hook is pending, and after a call of other sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ...kernels._util import tuning_changes
from ...kernels.geometry import fused_switch
from ...protocol import call_card as card
from ...runtime.checks import plain
from .handle import LLHandle, carve

Tensor = torch.Tensor


@dataclass(eq=False)
class DispatchShapes:
    """What a replayed dispatch checks its tensors against, and the shapes of what it allocates."""
    x: torch.Size                       # [T, H]
    topk_idx: torch.Size                # [T, K]
    idx_dtype: torch.dtype              # int64 or int32
    stats: Optional[torch.Size]         # [E_local], or None: no stats tensor
    cost: Optional[torch.Size]          # [R] or [R, R], or None: no cost tensor
    recv_x: torch.Size                  # [E_local, R*N, H]
    scales: Optional[torch.Size]        # [E_local, R*N, S], or None: bf16
    scales_stride: Optional[tuple]      # column-major in the last two dimensions
    scales_dtype: Optional[torch.dtype]  # fp32, or int32 (UE8M0)
    parts: tuple                        # the handle's tables and the scratch, as carve takes them


@dataclass(eq=False)
class CombineShapes:
    """What a replayed combine checks its tensors and handle against."""
    x: torch.Size                       # [E_local, R*N, H]
    topk_idx: torch.Size                # [T, K]
    idx_dtype: torch.dtype              # int64 or int32
    cost: Optional[torch.Size]          # [R] or [R, R], or None: no cost tensor
    sizes: tuple                        # the handle's (N, H, E)


@dataclass(eq=False)
class LLPlan:
    """What a low-latency call needs to launch again with the same sizes (see the module's docstring)."""
    ll: object                          # the Buffer's LowLatency
    key: tuple                          # the call's sizes and flags as its arguments give them
    card: tuple                         # (the call card's operation, its values)
    launch: object                      # the kernels.launch.Replay; None once dropped
    force: Optional[bool]               # TRITON_EP_FUSED when it was made
    shapes: Union[DispatchShapes, CombineShapes]
    tuning: int = field(init=False)     # the tuning tables' changes when it was made
    exchanges: int = field(init=False)  # the Runtime's host exchanges when it was made

    def __post_init__(self) -> None:
        self.tuning, self.exchanges = tuning_changes(), self.ll.rt.exchanges
        self.ll.rt.plans.add(self)      # (dropped when the Buffer is destroyed)

    def drop(self) -> None:
        """Forget the launch (and with it every reference to the Buffer's memory)."""
        self.launch = None

    def usable(self, sizes: tuple) -> bool:
        """Whether the state of the Buffer lets this plan serve a call now (its tensors are checked apart)."""
        ll = self.ll
        rt = ll.rt
        if self.launch is None or rt.comm is None or rt.sig.needs_resync or ll.pending or ll.net is not None:
            return False
        if ll.last_sizes != sizes or self.tuning != tuning_changes() or self.exchanges != rt.exchanges:
            return False
        try:
            if fused_switch() != self.force:
                return False
        except ValueError:
            return False
        return not (self.force is None and rt.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def dispatch_plan(ll, key: tuple, values: tuple, made: tuple, a, o, raw_cost: Optional[Tensor]) -> LLPlan:
    """The plan of a dispatch of one launch: ``made`` its ``(launch, args)``, ``a`` and ``o`` its
    :class:`~.calls.DispatchArgs` and :class:`~.calls.DispatchOutputs`, ``raw_cost`` the cost tensor passed."""
    launch, args = made
    vary = tuple(t for t in (a.x, a.topk_idx, o.slots, o.counts, o.recv_x, o.scales, o.src_info, o.ret_slot,
                             o.layout_range, o.recv_count, a.stats, a.cost) if t is not None)
    sc = o.scales
    shapes = DispatchShapes(a.x.shape, a.topk_idx.shape, a.topk_idx.dtype,
                            None if a.stats is None else a.stats.shape, None if raw_cost is None else raw_cost.shape,
                            o.recv_x.shape, None if sc is None else sc.shape, None if sc is None else sc.stride(),
                            None if sc is None else sc.dtype, o.parts)
    return LLPlan(ll, key, (card.LL_DISPATCH, values), launch.replay(args, vary), fused_switch(), shapes)


def combine_plan(ll, made: tuple, a, raw_cost: Optional[Tensor]) -> LLPlan:
    """The plan of a combine of one launch: ``made`` its ``(launch, args)``, ``a`` its
    :class:`~.calls.CombineArgs`, ``raw_cost`` the cost tensor passed."""
    launch, args = made
    h, lay = a.handle, a.lay
    vary = tuple(t for t in (a.x, h.ret_slot, h.recv_count, h.layout_range, a.topk_idx, a.weights, a.out, a.cost)
                 if t is not None)
    K = a.topk_idx.shape[1]
    shapes = CombineShapes(a.x.shape, a.topk_idx.shape, a.topk_idx.dtype,
                           None if raw_cost is None else raw_cost.shape, (lay.n_max, lay.hidden, lay.num_experts))
    return LLPlan(ll, (a.cost is None,), (card.LL_COMBINE, (lay.n_max, lay.hidden, lay.num_experts, K, 0)),
                  launch.replay(args, vary), fused_switch(), shapes)


def dispatch(ll, x, topk_idx, N, E, stats, cost, use_fp8, round_scale, use_ue8m0, async_finish):
    """``low_latency_dispatch`` without a receive hook by the plan of the last such call: DeepEP's result
    ``(recv_x, recv_count, handle, event, None)``, or ``None`` when the plan does not serve this call (nothing
    was done: take the general path)."""
    p = ll.replay_dispatch
    if N.__class__ is not int or E.__class__ is not int:     # (the general path says which values it takes)
        return None
    if p is None or p.key != (N, E, use_fp8, round_scale, use_ue8m0, stats is None, cost is None):
        return None
    rt = ll.rt
    dev = rt.device
    s = p.shapes
    if not (plain(x, s.x, torch.bfloat16, dev) and plain(topk_idx, s.topk_idx, s.idx_dtype, dev)):
        return None
    if stats is not None and not plain(stats, s.stats, torch.int32, dev):
        return None
    if cost is not None and not plain(cost, s.cost, torch.int64, dev):
        return None
    H = s.x[1]
    if not p.usable((N, H, E)):
        return None
    T, K = s.topk_idx
    rt.count_call(low_latency=True)
    rt.check()                          # (what every low-latency call does first)
    rt.publish(p.card[0], p.card[1])
    recv_x = torch.empty(s.recv_x, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16, device=dev)
    sc = torch.empty_strided(s.scales, s.scales_stride, dtype=s.scales_dtype, device=dev) if use_fp8 else None
    layout_range, recv_count, src_info, ret_slot, slots, counts = carve(dev, s.parts)
    idx_n = ll.claim_send()
    handle = LLHandle((src_info, layout_range, N, H, E), rt.uid, ret_slot, recv_count, T, K, idx_n)
    c = cost if cost is None or cost.dim() == 1 else cost[rt.rank]
    ts = tuple(t for t in (x, topk_idx, slots, counts, recv_x, sc, src_info, ret_slot, layout_range, recv_count,
                           stats, c) if t is not None)
    event = ll.launch(False, async_finish, lambda: p.launch(*ts), ts)
    rt.check()
    return (recv_x, sc) if use_fp8 else recv_x, recv_count, handle, event, None


def combine(ll, x, topk_idx, topk_weights, handle, cost, async_finish):
    """``low_latency_combine`` without a receive hook, ``zero_copy``, ``use_logfmt`` or ``out`` by the plan of the
    last such call: ``(combined_x, event, None)``, or ``None`` when the plan does not serve this call."""
    p = ll.replay_combine
    if p is None or p.key != (cost is None,):
        return None
    rt = ll.rt
    dev = rt.device
    s = p.shapes
    if handle.__class__ is not LLHandle or handle.buffer_uid != rt.uid or handle.call in ll.pending:
        return None
    sizes = handle.sizes
    if (handle.num_tokens, handle.num_topk) != s.topk_idx or sizes != s.sizes:
        return None
    if not (plain(x, s.x, torch.bfloat16, dev) and plain(topk_idx, s.topk_idx, s.idx_dtype, dev)
            and plain(topk_weights, s.topk_idx, torch.float32, dev)):
        return None
    if cost is not None and not plain(cost, s.cost, torch.int64, dev):
        return None
    if not p.usable(sizes):
        return None
    rt.count_call(low_latency=True)
    rt.check()
    rt.publish(p.card[0], p.card[1])
    out = torch.empty(s.topk_idx[0], sizes[1], dtype=torch.bfloat16, device=dev)
    ll.claim_send()
    c = cost if cost is None or cost.dim() == 1 else cost[rt.rank]
    ts = tuple(t for t in (x, handle.ret_slot, handle.recv_count, handle.layout_range, topk_idx, topk_weights, out, c)
               if t is not None)
    event = ll.launch(False, async_finish, lambda: p.launch(*ts), ts)
    rt.check()
    return out, event, None
