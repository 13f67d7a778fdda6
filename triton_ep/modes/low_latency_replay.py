"""Low-latency dispatch and combine calls made again with the sizes of the last call: the same launch, replayed.

Decode calls ``low_latency_dispatch`` and ``low_latency_combine`` every step with the same sizes and flags and only
fresh tensors. A call of one launch within one host (:meth:`LowLatency._one_launch`: no network leg, no receive
hook) leaves an :class:`LLPlan` on the Buffer's low-latency state: its sizes and flags, the call card's values,
the outputs' shapes and the launch with every argument but the call's own tensors
(:class:`triton_ep.kernels.launch.Replay`). The next call of those sizes and flags checks its tensors against the
plan (type, shape, dtype, device, contiguity, 4-byte alignment) and does what the general path does (the error
check, the call count and card, the outputs and the handle's tables, the send count, the launch, the event, the
error check) without working the rest out again. Any other call, or one that does not match its plan in any way,
takes the general path (:mod:`triton_ep.modes.low_latency`), which checks and raises as always and plans again.

A plan stops serving once the tuning tables changed, once the ranks re-synchronised after an error, for another
value of ``TRITON_EP_FUSED``, while a CUDA graph is being captured (the general path then takes the split
launches), while a receive hook is pending, and after a call of other sizes.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels._util import tuning_changes
from ..kernels.dispatch import fused_switch
from . import low_latency as LL     # (low_latency imports this module: its names are read at call time)
from .intranode_replay import plain

Tensor = torch.Tensor


class LLPlan:
    """What a low-latency call needs to launch again with the same sizes (see the module's docstring).

    Attributes:
        ll: the Buffer's low-latency state. key: the call's sizes and flags as its arguments give them. card: the
        call card's values. launch: the :class:`triton_ep.kernels.launch.Replay` (``None`` once dropped). force,
        tuning, exchanges: as :class:`triton_ep.modes.intranode_replay.CallPlan`'s. Per kind (dispatch or
        combine) the tensors' shapes and dtypes the call checks.
    """

    __slots__ = ("ll", "key", "card", "launch", "force", "tuning", "exchanges", "shapes", "extra", "__weakref__")

    def __init__(self, ll, key: tuple, card_values: tuple, launch, force: Optional[bool], shapes: tuple,
                 extra: tuple) -> None:
        self.ll, self.key, self.card, self.launch, self.force, self.shapes, self.extra = \
            ll, key, tuple(card_values), launch, force, shapes, extra
        self.tuning, self.exchanges = tuning_changes(), ll.rt.exchanges
        ll.rt.plans.add(self)       # (dropped when the Buffer is destroyed)

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
    xs, idx_shape, idx_dtype, stats_shape, cost_shape = p.shapes
    if not (plain(x, xs, torch.bfloat16, dev) and plain(topk_idx, idx_shape, idx_dtype, dev)):
        return None
    if stats is not None and not plain(stats, stats_shape, torch.int32, dev):
        return None
    if cost is not None and not plain(cost, cost_shape, torch.int64, dev):
        return None
    H = xs[1]
    if not p.usable((N, H, E)):
        return None
    T, K = idx_shape
    recv_shape, sc_shape, sc_stride, sc_dtype, parts = p.extra
    rt.check()                          # (what every low-latency call does first)
    rt.count_call()
    rt.publish(p.card[0], p.card[1])
    recv_x = torch.empty(recv_shape, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16, device=dev)
    sc = torch.empty_strided(sc_shape, sc_stride, dtype=sc_dtype, device=dev) if use_fp8 else None
    layout_range, recv_count, src_info, ret_slot, slots, counts = LL.carve(dev, parts)
    idx_n = ll._claim_send()
    handle = LL.LLHandle((src_info, layout_range, N, H, E), rt.uid, ret_slot, recv_count, T, K, idx_n)
    c = cost if cost is None or cost.dim() == 1 else cost[rt.rank]
    ts = tuple(t for t in (x, topk_idx, slots, counts, recv_x, sc, src_info, ret_slot, layout_range, recv_count,
                           stats, c) if t is not None)
    event = ll._launch(False, async_finish, lambda: p.launch(*ts), ts)
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
    xs, idx_shape, idx_dtype, cost_shape = p.shapes
    if handle.__class__ is not LL.LLHandle or handle.buffer_uid != rt.uid or handle.call in ll.pending:
        return None
    N, H, E = handle[2], handle[3], handle[4]
    if (handle.num_tokens, handle.num_topk) != idx_shape or (N, H, E) != p.extra:
        return None
    if not (plain(x, xs, torch.bfloat16, dev) and plain(topk_idx, idx_shape, idx_dtype, dev)
            and plain(topk_weights, idx_shape, torch.float32, dev)):
        return None
    if cost is not None and not plain(cost, cost_shape, torch.int64, dev):
        return None
    if not p.usable((N, H, E)):
        return None
    rt.check()
    rt.count_call()
    rt.publish(p.card[0], p.card[1])
    out = torch.empty(idx_shape[0], H, dtype=torch.bfloat16, device=dev)
    ll._claim_send()
    c = cost if cost is None or cost.dim() == 1 else cost[rt.rank]
    ts = tuple(t for t in (x, handle.ret_slot, handle.recv_count, handle[1], topk_idx, topk_weights, out, c)
               if t is not None)
    event = ll._launch(False, async_finish, lambda: p.launch(*ts), ts)
    rt.check()
    return out, event, None
