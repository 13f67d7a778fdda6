"""Cached dispatch, combine and layout calls made again with the shapes of their last call: the same launches,
replayed.

A cached ``dispatch`` (``handle=...``) of plain ``x`` (no scales), or a ``combine`` without bias, leaves a :class:`CallPlan` on its handle: what the next call of that handle with the same shapes needs (the
call card's values, the output's shape, the call's launches with every argument but the call's own tensors,
:class:`triton_ep.kernels.launch.Replay`: one launch up to ``tuning("fused")["max_tokens"]`` tokens,
:func:`triton_ep.kernels.geometry.use_fused`, else a send and a receive launch per round).
That next call checks its tensors against the plan (type, shape, dtype, device, contiguity, 4-byte
alignment), then does what the general path does (the call count, the error check, the card, the stream
order, the output's allocation, the launch, the event, the error check) without working the rest out again.
A call that does not match its plan in any way, or any other argument than the defaults, ``config``,
``previous_event`` and ``async_finish``, takes the general path (:mod:`triton_ep.modes.intranode`), which
checks and raises as always and plans again.

``get_dispatch_layout`` (within one host) likewise keeps a :class:`LayoutCall` on the Buffer: the next layout of a
``topk_idx`` of the same shape and dtype and the same ``num_experts`` allocates its outputs and replays the
layout's launches (:class:`triton_ep.kernels.layout.LayoutPlan`).

Why: on an H200 machine most of a cached dispatch's or a combine's host time was the Python around its one
launch (benchmarks/README.md), checks and bookkeeping that give the same answer as on the previous call.

A plan is made for one Config (its launch parameters' key, :func:`triton_ep.kernels.params.config_key`: a call
without a Config after ``Buffer.set_num_sms`` has its own key): a call with a Config of another key takes the
general path, which launches as that Config says and plans again (the handle then replays the new Config's
plan). A plan also stops serving once the tuning tables changed
(:func:`triton_ep.kernels._util.tuning_changes`), once the ranks met to re-synchronise after an error, and for
another value of ``TRITON_EP_FUSED`` (read on every call, as by the general path).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..config import EventOverlap
from ..kernels._util import tuning_changes
from ..kernels.geometry import fused_switch
from ..kernels.params import config_key
from ..runtime.checks import check_config, check_event, plain

Tensor = torch.Tensor


class CallPlan:
    """What a call of one handle needs to launch again with the same shapes (see the module's docstring).

    Attributes:
        rt: a weak reference to the Runtime of the Buffer that made it (the plan drops its launches when that
        Runtime goes). shape, dtype: ``x``'s (a ``torch.Size``, a dtype).
        k: ``topk_weights``' columns for a combine (0: none). out_shape: the output's shape.
        code, card: the call card's operation and values. launches: the call's launches in order
        (:class:`triton_ep.kernels.launch.Replay` each: one for a call of one launch, a send and a receive per round
        otherwise), ``None`` once the Buffer was destroyed (:meth:`drop`: they referenced its shared memory).
        force, tuning, exchanges: ``TRITON_EP_FUSED``, the tuning tables' changes and the Runtime's host
        exchanges when it was made (another value makes it stale). params_key: the key of the Config it was made
        for (:func:`triton_ep.kernels.params.config_key`; a call of another key does not replay it). sums: a combine of several rounds, whose
        launches carry the sums over in fp32 tensors ``[T, H]`` (and ``[T, K]`` with weights) made per call.
    """

    __slots__ = ("rt", "shape", "dtype", "k", "out_shape", "code", "card", "launches", "force", "tuning",
                 "exchanges", "sums", "params_key", "__weakref__")

    def __init__(self, rt, x: Tensor, k: int, out_shape: tuple, code: int, card_values: tuple, launches: tuple,
                 force: Optional[bool], sums: bool = False, params_key: Optional[tuple] = None) -> None:
        self.sums, self.params_key = sums, params_key
        # (weakly, and the launches go with the Runtime: a handle kept after its Buffer was dropped without
        # destroy() keeps nothing of the Buffer alive, its shared memory included)
        me = weakref.ref(self)
        self.rt = weakref.ref(rt, lambda _: me() is not None and me().drop())
        self.shape, self.dtype, self.k, self.out_shape = x.shape, x.dtype, k, tuple(out_shape)
        self.code, self.card, self.launches, self.force = code, tuple(card_values), launches, force
        self.tuning, self.exchanges = tuning_changes(), rt.exchanges
        rt.plans.add(self)      # (dropped when the Buffer is destroyed)

    def drop(self) -> None:
        """Forget the launches (and with them every reference to the Buffer's memory): the plan serves no call."""
        self.launches = None


class LayoutCall:
    """What ``get_dispatch_layout`` needs to launch again for a ``topk_idx`` of the same shape and dtype and the
    same ``num_experts``: the :class:`triton_ep.kernels.layout.LayoutPlan` (``None`` once dropped)."""

    __slots__ = ("rt", "shape", "dtype", "num_experts", "plan", "tuning", "__weakref__")

    def __init__(self, rt, topk_idx: Tensor, num_experts: int, plan) -> None:
        self.rt, self.shape, self.dtype = rt, topk_idx.shape, topk_idx.dtype
        self.num_experts, self.plan = num_experts, plan
        self.tuning = tuning_changes()
        rt.plans.add(self)

    def drop(self) -> None:
        """Forget the launches."""
        self.plan = None


def layout(mode, topk_idx, num_experts, previous_event, async_finish: bool):
    """``Buffer.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish)`` (within one host) by the
    plan of the last layout: its results, or ``None`` when the plan does not serve this call (nothing was done)."""
    p = mode.replay_layout
    rt = mode.rt
    if p is None or p.plan is None or num_experts.__class__ is not int or num_experts != p.num_experts:
        return None
    if not plain(topk_idx, p.shape, p.dtype, rt.device) or rt.comm is None or p.tuning != tuning_changes():
        return None
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        return None
    rt.check()
    rt.begin(previous_event, async_finish)
    with rt.comm_ctx():
        lay = p.plan(topk_idx)
    per_rank, per_expert, in_rank = lay[:3]
    mode.remember_layout(topk_idx, num_experts, lay)
    return per_rank, None, per_expert, in_rank, rt.end(async_finish, (topk_idx, per_rank, per_expert, in_rank))


def _usable(p: Optional[CallPlan], rt, x, config, previous_event) -> bool:
    """Whether plan ``p`` serves a call of ``x``, ``config`` and ``previous_event`` now (no side effect: any
    doubt says no, and the general path checks and raises)."""
    if p is None or p.rt() is not rt or p.launches is None or not plain(x, p.shape, p.dtype, rt.device):
        return False
    if rt.comm is None or rt.sig.needs_resync:
        return False
    if p.tuning != tuning_changes() or p.exchanges != rt.exchanges:
        return False
    try:
        check_config(config)
        if config_key(config) != p.params_key:      # (another Config: the general path launches as it says)
            return False
        check_event(previous_event)
        return fused_switch() == p.force
    except (TypeError, ValueError):
        return False


def _run(rt, p: CallPlan, previous_event, async_finish: bool, x: Tensor, w: Optional[Tensor],
         keep: tuple):
    """The call of plan ``p``, as the general path makes it: count it, raise a recorded error, publish the
    card, order after the caller's work, allocate the outputs, launch, hand back the event, raise
    an error recorded meanwhile. Returns ``(out, wout, event)``."""
    rt.count_call()
    started = False
    try:
        rt.check()
        rt.publish(p.code, p.card)
        rt.begin(previous_event, async_finish)
        started = True
        dev = rt.device
        out = torch.empty(p.out_shape, dtype=x.dtype, device=dev)
        wout = torch.empty((p.out_shape[0], p.k), dtype=torch.float32, device=dev) if w is not None else None
        ts = (x, out) if w is None else (x, w, out, wout)
        if p.sums:          # (a combine of several rounds: its fp32 sums, as the general path makes them)
            ts += (torch.empty(p.out_shape, dtype=torch.float32, device=dev),)
            if w is not None:
                ts += (torch.empty((p.out_shape[0], p.k), dtype=torch.float32, device=dev),)
        with rt.comm_ctx():
            for launch in p.launches:
                with rt.sig.watch():
                    launch(*ts)
        event = rt.end(async_finish, ts + keep)
        rt.check()
        return out, wout, event
    except BaseException as e:
        rt.tell_failure(e)
        if started:
            rt.broke_mid_call(e)
        raise


def cached_dispatch(rt, handle, x, config, previous_event, async_finish: bool):
    """``Buffer.dispatch(x, handle=handle, config=..., previous_event=..., async_finish=...)`` by the handle's
    plan: DeepEP's cached dispatch result ``(recv_x, None, None, None, None, event)``, or ``None`` when the
    plan does not serve this call (then nothing was done: take the general path). Raises what the general
    path raises once the call started (a recorded error, an allocation failure)."""
    p = handle.replay_dispatch
    if not _usable(p, rt, x, config, previous_event):
        return None
    out, _, event = _run(rt, p, previous_event, async_finish, x, None, (handle.send_head, handle.row_base))
    return out, None, None, None, None, event


def combine(rt, handle, x, topk_weights, config, previous_event, async_finish: bool):
    """``Buffer.combine(x, handle, topk_weights, config=..., previous_event=..., async_finish=...)`` (no bias)
    by the handle's plan: ``(combined_x, combined_topk_weights or None, event)``, or ``None`` when the plan
    does not serve this call (nothing was done). Raises as :func:`cached_dispatch`."""
    p = handle.replay_combine
    if not _usable(p, rt, x, config, previous_event):
        return None
    w = topk_weights
    if w is None:
        if p.k:
            return None
    elif not p.k or not plain(w, (p.shape[0], p.k), torch.float32, rt.device):
        return None
    return _run(rt, p, previous_event, async_finish, x, w, (handle.send_head,))
