"""The handle and the event of :class:`~triton_ep.elastic.ElasticBuffer`: DeepEP V2's ``deep_ep.EPHandle`` and
``deep_ep._C.EventHandle``."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from ..runtime import current_event

Tensor = torch.Tensor


class EventHandle:
    """DeepEP V2's ``EventHandle`` (``deep_ep._C.EventHandle``, ``csrc/utils/event.hpp`` at dd758ca): made with no
    argument, it records an event on the current CUDA stream. :meth:`ElasticBuffer.capture` returns one, and
    ``previous_event`` / ``previous_event_before_epilogue`` take one. A CUDA stream's ``wait_event`` takes it too
    (through :meth:`wait`), so ``EventOverlap(EventHandle())`` works as in DeepEP.

    Attributes:
        event: the ``torch.cuda.Event`` recorded at construction, or ``None`` where CUDA is not available (on CPU
            every call has finished when it returns, so there is nothing to wait for).
    """

    def __init__(self) -> None:
        self.event = current_event().event

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (DeepEP's; a no-op without one). Returns at once: only
        work queued later on the stream waits."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for the event, as ``torch.cuda.Event.wait``
        (what ``torch.cuda.Stream.wait_event`` calls); a no-op without one."""
        if self.event is not None:
            self.event.wait(stream)


@dataclasses.dataclass(eq=False)
class EPHandle:
    """The handle of an :meth:`ElasticBuffer.dispatch`: pass it to ``combine`` (the routes back) or to ``dispatch``
    again (a cached dispatch: same routing, new data, no host wait). V2's ``deep_ep.EPHandle`` fields, with V2's
    meanings (``R`` ranks, ``E_l`` local experts, ``K`` top-k, ``N`` non-expanded rows here):

    Attributes:
        do_expand: whether the dispatch that made it used the expanded layout.
        num_experts: ``E``. expert_alignment: each local expert's count rounded up to a multiple of it.
        num_max_tokens_per_rank: the per-rank token bound of the dispatch (sizes the worst case, and
            ``src_token_global_idx = src_rank * num_max_tokens_per_rank + src_token``).
        num_sms: the ``num_sms`` of the dispatch (accepted; results never depend on it).
        topk_idx: the dispatch's ``topk_idx`` ``[T, K]`` (a copy unless ``do_handle_copy=False``).
        num_recv_tokens: ``N``: the received tokens, or the worst case ``R * num_max_tokens_per_rank`` without a
            host wait (the real count is then ``psum_num_recv_tokens_per_scaleup_rank[-1]``, on the device).
        num_expanded_tokens: rows of the expanded layout (the sum of the aligned per-expert counts, or its worst
            case without a host wait).
        num_recv_tokens_per_expert_list: Python ints ``[E_l]``, each expert's received count rounded up to
            ``expert_alignment``; an empty list without a host wait (``do_cpu_sync=False``), as in V2.
        psum_num_recv_tokens_per_scaleup_rank: int32 ``[R]``: inclusive prefix sum over source ranks of the
            tokens received from each (a token counted once per rank); its last entry is the real ``N``.
        psum_num_recv_tokens_per_expert: int32 ``[E_l]``: non-expanded, the inclusive prefix sum of the aligned
            counts; expanded, ``start(e) + count(e)`` where ``start(e)`` is the sum of the earlier experts' aligned
            counts (``align(psum[e], expert_alignment)`` is then expert ``e + 1``'s start).
        num_unaligned_recv_tokens_per_expert: int32 ``[E_l]``: the received counts, not rounded.
        recv_src_metadata: int32 ``[N, K + 2]``: per received token, ``src_rank * num_max_tokens_per_rank +
            src_token``; ``src_rank * K + k0`` (``k0`` the first top-k slot whose expert is on this rank); then per
            top-k slot its row in the expanded layout (``-1`` where the expert is elsewhere, and everywhere for a
            non-expanded dispatch). Worst-case padding rows hold ``-1``.
        dst_buffer_slot_idx, token_metadata_at_forward, channel_linked_list: V2's kernel-side tables; ``None``
            here (nothing reads them).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: List[int]
    psum_num_recv_tokens_per_scaleup_rank: Tensor
    psum_num_recv_tokens_per_expert: Tensor
    num_unaligned_recv_tokens_per_expert: Tensor
    recv_src_metadata: Tensor
    dst_buffer_slot_idx: Optional[Tensor] = None
    token_metadata_at_forward: Optional[Tensor] = None
    channel_linked_list: Optional[Tensor] = None
    #: the Buffer handle of the underlying normal-mode dispatch
    buffer_handle: tuple = dataclasses.field(default=(), repr=False)
    #: the non-expanded local ids ``[N, K]``, a copy (callers may rewrite the returned ids in place, as vLLM does): what
    #: a cached dispatch returns again, and what masks combine's weights
    recv_topk_idx: Optional[Tensor] = dataclasses.field(default=None, repr=False)
    #: the number of the ElasticBuffer that made it
    owner: int = dataclasses.field(default=0, repr=False)
