"""The argument checks of :class:`~triton_ep.elastic.ElasticBuffer`'s calls, made before anything launches (a
rejection then reaches the peers through ``ElasticBuffer._agreed``), and the checked arguments they give
(:class:`DispatchPlan`, :class:`Order`). ``eb``: the ElasticBuffer (its group size, device, default token bound and
number)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..config import EventOverlap
from ..runtime.checks import MAX_HIDDEN, MAX_INT32, check_num_experts, check_tensor, isint
from .handle import EPHandle, EventHandle

Tensor = torch.Tensor


def count(name: str, v, lo: int = 0, hi: int = MAX_INT32, why: str = "") -> int:
    """``v`` as an int in ``[lo, hi]`` (default ``[lo, 2^31)``); ``ValueError`` naming ``name`` otherwise, with
    ``why`` (the bound's reason) after the range."""
    if not isint(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}]{why}, got {v!r}")
    return int(v)


def hidden_count(v, lo: int = 0) -> int:
    """ElasticBuffer's ``hidden`` as an int in ``[lo, MAX_HIDDEN]``; ``ValueError`` naming ``hidden`` otherwise
    (where it used to be the size hint's ``hidden_bytes``, an argument the caller never passed)."""
    return count("hidden", v, lo, MAX_HIDDEN, " (a bf16 row of 2 * hidden bytes, an int32 count of bytes)")


def as_event(ev, name: str) -> Optional[EventOverlap]:
    """``ev`` as the :class:`EventOverlap` Buffer takes: ``None``, an :class:`EventHandle` (``capture()``'s), an
    EventOverlap (``Buffer.capture()``'s), or a CUDA event."""
    if ev is None or isinstance(ev, EventOverlap):
        return ev
    if isinstance(ev, EventHandle):
        return EventOverlap(ev.event)
    if torch.cuda.is_available() and isinstance(ev, torch.cuda.Event):
        return EventOverlap(ev)
    raise TypeError(f"{name} must be an EventHandle (ElasticBuffer.capture()), an EventOverlap or a torch.cuda.Event, "
                    f"got {type(ev).__name__}")


def v2_names(message: str) -> str:
    """``message`` (an error of :class:`~triton_ep.Buffer`'s set-up) with V1's argument names replaced by the V2
    arguments ElasticBuffer passes them from: ``num_nvl_bytes`` is ``num_bytes``, ``timeout_s`` is
    ``num_gpu_timeout_secs``."""
    return message.replace("num_nvl_bytes", "num_bytes").replace("timeout_s ", "num_gpu_timeout_secs ")


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """A dispatch without a handle, its arguments checked (:func:`check_dispatch`)."""

    num_topk: int               # K: columns of topk_idx
    num_experts: int            # E, a multiple of R
    num_local_experts: int      # E_l = E / R
    num_max: int                # num_max_tokens_per_rank: the worst case is R * num_max received tokens
    alignment: int              # expert_alignment, >= 1
    sync: bool                  # do_cpu_sync: exact sizes (a host wait), else the worst case
    expand: bool                # do_expand: the expanded layout


@dataclasses.dataclass(frozen=True)
class Order:
    """How a dispatch is ordered on the streams (its arguments, checked)."""

    previous_event: Optional[EventOverlap]      # waited for before the call's kernels
    before_epilogue: Optional[EventOverlap]     # previous_event_before_epilogue: waited for before this rank's epilogue
    async_: bool                                # async_with_compute_stream: on the communication stream, an event back
    alloc_comm: bool                            # allocate_on_comm_stream: outputs allocated there


def check_call(x, num_sms, num_qps, do_expand: bool, do_zero_padding: bool, previous_event,
                previous_event_before_epilogue, async_with_compute_stream: bool,
                allocate_on_comm_stream: bool) -> Tuple[int, Order]:
    """The checks every dispatch makes, with or without a handle: ``x`` (a 2-D tensor or an ``(x, sf)`` pair),
    the accepted counts, ``do_zero_padding`` and the events. Returns ``T`` and the call's :class:`Order`."""
    for name, v in (("num_sms", num_sms), ("num_qps", num_qps)):
        count(name, v)
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding needs do_expand=True (it zeroes the expanded layout's padding rows)")
    if isinstance(x, tuple) and len(x) != 2:
        raise ValueError(f"x must be a tensor or an (x, sf) pair, got a tuple of {len(x)}")
    xs = x[0] if isinstance(x, tuple) else x
    if not isinstance(xs, torch.Tensor) or xs.dim() != 2:
        raise TypeError(f"x must be a 2-D tensor [T, H] (or an (x, sf) pair), got "
                        f"{tuple(xs.shape) if isinstance(xs, torch.Tensor) else type(xs).__name__}")
    return xs.shape[0], Order(as_event(previous_event, "previous_event"),
                               as_event(previous_event_before_epilogue, "previous_event_before_epilogue"),
                               bool(async_with_compute_stream), bool(allocate_on_comm_stream))


def check_dispatch(eb, T: int, topk_idx, stats, num_experts, num_max_tokens_per_rank, expert_alignment,
                    sync: bool, expand: bool) -> DispatchPlan:
    """The checks of a dispatch without a handle, the layout's among them (``Buffer.get_dispatch_layout`` checks
    ``topk_idx`` on this rank alone): the call's :class:`DispatchPlan`."""
    if topk_idx is None:
        raise ValueError("dispatch needs topk_idx (or a handle of an earlier dispatch)")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx must be [T, K] with T = {T} rows of x, got "
                         f"{tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
    check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (T, None), eb.device)
    if num_experts is None:
        raise ValueError("dispatch needs num_experts (or a handle of an earlier dispatch)")
    check_num_experts(num_experts, eb.num_ranks)
    N_max = num_max(eb, num_max_tokens_per_rank, T)
    align = 1 if expert_alignment is None else count("expert_alignment", expert_alignment, 1)
    El = num_experts // eb.num_ranks
    check_stats(eb, stats, El)
    return DispatchPlan(topk_idx.shape[1], int(num_experts), El, N_max, align, sync, bool(expand))


def check_cached(eb, T: int, handle, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank,
                  expert_alignment, do_cpu_sync, do_expand) -> None:
    """The checks of a cached dispatch (with ``handle``): the call must be the handle's kind of dispatch. The new
    data may differ from the handle's dispatch in hidden size and dtype (an FP8 pair after bf16 rows, as in V2,
    whose cached mode re-sends whatever rows it is given); its rows, ids and layout may not.

    Raises:
        TypeError: ``handle`` is no EPHandle (a Buffer's handle, say), ``topk_weights`` or the stats of another
            dtype. ValueError: a handle of another buffer; ``topk_idx`` or ``do_cpu_sync=True`` with it;
            ``num_experts``, ``num_max_tokens_per_rank``, ``expert_alignment`` or ``do_expand`` other than the
            handle's (:func:`check_layout`); ``x`` of another ``T``; ``topk_weights`` not ``[T, K]``; the stats not
            ``[E_l]``.
    """
    check_handle(eb, handle, "handle")
    if topk_idx is not None:
        raise ValueError("a cached dispatch (with handle) takes no topk_idx: the handle's routing is used")
    if do_cpu_sync:
        raise ValueError("a cached dispatch (with handle) cannot do_cpu_sync: its counts are the handle's")
    for name, given, have in (("num_experts", num_experts, handle.num_experts),
                              ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
                              ("expert_alignment", expert_alignment, handle.expert_alignment)):
        if given is not None and given != have:
            raise ValueError(f"{name} {given!r} differs from the handle's {have}")
    check_layout(handle, do_expand)
    K = handle.topk_idx.shape[1]
    if T != handle.topk_idx.shape[0]:
        raise ValueError(f"x has {T} rows, the handle's dispatch had {handle.topk_idx.shape[0]}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, (torch.float32,), (T, K), eb.device,
                     "the handle's dispatch's T and K")
    check_stats(eb, stats, handle.num_experts // eb.num_ranks)


def check_layout(handle: EPHandle, do_expand) -> None:
    """A cached dispatch's ``do_expand`` must be its handle's: the handle's tables describe one layout.

    DeepEP V2 (``ElasticBuffer.dispatch`` and its copy epilogue, dd758ca) checks neither direction. With
    ``do_expand=True`` and a non-expanded handle its epilogue reads expanded row numbers from
    ``recv_src_metadata[:, 2:]``, which a non-expanded dispatch never wrote (undefined). With ``do_expand=False`` and
    an expanded handle it returns non-expanded rows in its receive buffer's arrival order, left unsorted even under
    ``deterministic=True`` (its sort skips cached dispatches of expanded handles), and no call takes them back:
    ``combine`` reads the layout from ``handle.do_expand``. Both are rejected here.

    Raises:
        ValueError: naming ``do_expand`` and the handle's layout.
    """
    if bool(do_expand) == bool(handle.do_expand):
        return
    if do_expand:
        raise ValueError("do_expand=True needs a handle of an expanded dispatch; this handle's dispatch was "
                         "non-expanded (do_expand=False): pass do_expand=False, or dispatch again with do_expand=True")
    raise ValueError("do_expand=False with a handle of an expanded dispatch (do_expand=True): a cached dispatch "
                     "returns its handle's layout, pass do_expand=True (non-expanded rows could not be combined with "
                     "this handle: combine takes the layout of its dispatch)")


def check_combine(eb, x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                   previous_event_before_epilogue):
    """The checks of a combine: ``(previous_event, previous_event_before_epilogue, K, N, rows of x)``.

    Raises:
        TypeError: ``handle`` is no EPHandle, ``x`` not bf16 2-D, ``topk_weights`` not fp32, a bad event.
        ValueError: a handle of another buffer; ``x`` or ``topk_weights`` not in the handle's layout (expanded:
            ``[num_expanded_tokens, H]`` and ``[num_expanded_tokens]``; else ``[N, H]`` and ``[N, K]``); three
            biases.
    """
    for name, v in (("num_sms", num_sms), ("num_qps", num_qps)):
        count(name, v)
    check_handle(eb, handle, "handle")
    prev, prev_epi = as_event(previous_event, "previous_event"), as_event(previous_event_before_epilogue,
                                                                              "previous_event_before_epilogue")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"combine's x must be a bf16 [rows, H] tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    K, N = handle.topk_idx.shape[1], handle.recv_topk_idx.shape[0]
    rows = handle.num_expanded_tokens if handle.do_expand else N
    if x.shape[0] != rows:
        raise ValueError(f"combine's x must have {rows} rows ({'num_expanded_tokens' if handle.do_expand else 'N'} "
                         f"of the handle's dispatch), got {x.shape[0]}")
    if topk_weights is not None:
        want_w = (rows,) if handle.do_expand else (rows, K)
        why = ("num_expanded_tokens of the handle's expanded dispatch" if handle.do_expand else
               "N rows and K of the handle's non-expanded dispatch")
        check_tensor("topk_weights", topk_weights, (torch.float32,), want_w, eb.device, why)
    if isinstance(bias, tuple) and len(bias) != 2:
        raise ValueError(f"bias must be a tensor or a pair of tensors, got a tuple of {len(bias)}")
    return prev, prev_epi, K, N, rows


def num_max(eb, given, T: int) -> int:
    """The per-rank token bound of a dispatch of ``T`` tokens: ``given``, or ``eb``'s default.

    Raises:
        ValueError: naming ``num_max_tokens_per_rank``: none given nor set, ``T`` above it, or ``R`` times it past
            int32 (the worst case's ``R * N_max`` rows, and ``src_rank * N_max + src_token`` in
            ``recv_src_metadata``, are int32).
    """
    n = eb.num_max_tokens_per_rank if given is None else count("num_max_tokens_per_rank", given)
    if n <= 0:
        raise ValueError("num_max_tokens_per_rank is needed: pass it to dispatch or to the constructor")
    if eb.num_ranks * n > MAX_INT32:
        raise ValueError(f"num_max_tokens_per_rank must be at most {MAX_INT32 // eb.num_ranks} with {eb.num_ranks} "
                         f"ranks (R * num_max_tokens_per_rank, the worst case's rows and the bound of "
                         f"recv_src_metadata's source index, is int32), got {n} ({eb.num_ranks * n})")
    if T > n:
        raise ValueError(f"x has {T} tokens, more than num_max_tokens_per_rank = {n}")
    return n


def check_stats(eb, stats, El: int) -> None:
    """``cumulative_local_expert_recv_stats`` must be ``None`` or int32 ``[E_l]`` on ``eb``'s device.

    Raises:
        TypeError: not a tensor, or not int32. ValueError: another shape (``E_l`` of ``num_experts`` or of the
        handle's dispatch) or device.
    """
    if stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", stats, (torch.int32,), (El,), eb.device,
                     f"E_l = num_experts / {eb.num_ranks} ranks")


def check_handle(eb, handle, name: str) -> None:
    """``handle`` must be an :class:`EPHandle` that ``eb`` made."""
    if not isinstance(handle, EPHandle):
        what = type(handle).__name__
        if what in ("DispatchHandle", "InternodeHandle", "LLHandle", "tuple"):
            what += " (a Buffer's handle: pass it to that Buffer's calls)"
        raise TypeError(f"{name} must be an EPHandle from ElasticBuffer.dispatch, got {what}")
    if handle.owner != eb._number:
        raise ValueError(f"{name} comes from another ElasticBuffer; pass the handle this buffer's dispatch returned")
