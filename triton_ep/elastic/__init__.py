"""``ElasticBuffer``: DeepEP V2's expert-parallel face (``deep_ep.ElasticBuffer``, DeepEP 2.x), served by the same
modes as :class:`~triton_ep.Buffer`.

DeepEP V2 unifies V1's two modes behind one ``dispatch`` / ``combine`` pair whose outputs come in two layouts:

- **non-expanded** (``do_expand=False``): one row per (token, destination rank), as V1's normal mode: rows grouped
  by source rank in rank order, the source's token order within a group; ``recv_topk_idx`` holds local expert ids
  (``-1`` where the expert lives elsewhere);
- **expanded** (``do_expand=True``): one row per (token, local expert) pair, the rows of each local expert
  contiguous, expert ``e``'s segment starting at the sum of the earlier experts' counts each rounded up to
  ``expert_alignment``; the weights come as a 1-D tensor, one per row; no ``recv_topk_idx``.

and two sizes: exact (``do_cpu_sync=True``: the host waits for the receive counts) or worst case
(``do_cpu_sync=False``: no host wait, CUDA-graph capturable; ``num_max_tokens_per_rank * R`` rows, or the expanded
worst case, the real count on the device in ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``).

Here every V2 call is one of :class:`~triton_ep.Buffer`'s normal-mode calls (``get_dispatch_layout`` +
``dispatch``, a cached ``dispatch``, ``combine``; ``do_cpu_sync=False`` is ``num_worst_tokens = R *
num_max_tokens_per_rank``), made through Buffer's public methods, plus local tensor work on this rank for the
expanded layout (a stable sort of the received ids into expert segments, gathers into the output). The semantics
are written out in :mod:`triton_ep.reference` (``elastic_dispatch``, ``elastic_combine``); docs/api_v1_v2.md puts
the V1 and V2 arguments side by side and lists every place where V2's source left the behaviour open. The source
of the semantics: DeepEP V2's ``deep_ep/buffers/elastic.py`` (docstrings, handle fields) and its kernels
(``dispatch.cuh``, ``dispatch_copy_epilogue.cuh``, ``combine_reduce_epilogue.cuh``), commit dd758ca.

V2's other primitives (Engram, pipeline-parallel send/recv, AGRS) raise ``NotImplementedError`` naming themselves.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import List, Optional, Tuple, Union

import torch

from ..buffer import Buffer
from ..config import Config, EventOverlap
from ..runtime.checks import isint
from .checks import (DispatchPlan, Order, check_cached, check_call, check_combine, check_dispatch, count,
                     hidden_count, v2_names)
from .handle import EPHandle, EventHandle
from .layout import (Expansion, align, col_major, expansion, gather_rows, psum_per_rank, reduce_expanded, sources,
                     src_metadata, unaligned_counts)

Tensor = torch.Tensor
XLike = Union[Tensor, Tuple[Tensor, Tensor]]

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle"]

#: V2's buffer sizes are multiples of 2 MiB (``get_elastic_buffer_alignment()``)
BUFFER_ALIGNMENT = 2 << 20
#: a number per ElasticBuffer (a handle names the buffer that made it; ``id()`` may be reused after collection)
_BUFFER_NUMBERS = itertools.count(1)
#: the handle this rank passes to the Buffer call it makes only to reject it (:meth:`ElasticBuffer._agreed`) when
#: the caller's handle is no EPHandle: any object but None makes it a cached dispatch (Buffer then rejects x=None)
_NOT_A_HANDLE = object()


def _primitive(name: str, what: str):
    """A stand-in for V2's ``ElasticBuffer.<name>`` (one of its ``what`` primitives), which triton-ep does not
    provide: it raises ``NotImplementedError`` naming itself."""
    def not_provided(*args, **kwargs):
        raise NotImplementedError(f"ElasticBuffer.{name} (DeepEP V2's {what} primitive) is not provided by triton-ep: "
                                  f"only expert-parallel dispatch and combine are")
    not_provided.__name__ = not_provided.__qualname__ = name
    not_provided.__doc__ = f"DeepEP V2's ``{name}`` ({what}): not provided. Raises NotImplementedError naming itself."
    return not_provided


class ElasticBuffer:
    """DeepEP V2's ``deep_ep.ElasticBuffer`` for expert parallelism: ``dispatch`` / ``combine`` in V2's layouts,
    served by :class:`~triton_ep.Buffer`'s normal mode (within one host and across hosts).

    Args:
        group: the EP process group (any backend; ``None``: the default group).
        num_bytes: bytes of the underlying Buffer's intranode buffer; ``None``: :meth:`get_buffer_size_hint` of
            ``hidden`` (transfers larger than the buffer go through it in rounds, so it never depends on the
            token count). An int in ``[0, 2^62]``.
        num_cpu_bytes: V2's CPU buffer for Engram storage: accepted, nothing is allocated (Engram is not served).
        num_max_tokens_per_rank: the default per-rank token bound of ``dispatch`` (``0``: each call passes one).
        hidden, num_topk, use_fp8_dispatch: V2's MoE settings for the size (``hidden`` is needed without
            ``num_bytes``); ``num_topk`` and ``use_fp8_dispatch`` do not change it here.
        deterministic: accepted; the receive order here is always V2's deterministic order (by source rank, then
            source token).
        allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx, num_allocated_qps:
            V2's transport and tuning knobs: accepted, results never depend on them (docs/api_v1_v2.md).
        num_cpu_timeout_secs: accepted (the host's wait for the receive counts is bounded by the GPU bound below).
        num_gpu_timeout_secs: bound in seconds on every wait for a peer (Buffer's ``timeout_s``).
        explicitly_destroy: accepted; ``destroy()`` works either way, and the buffers are released when the object
            is collected.
        device, rdma_backend: triton-ep's own (keyword only), as :class:`~triton_ep.Buffer`'s.

    Raises:
        ValueError/TypeError: a bad argument on any rank, before anything is built: raised on every rank at once,
            naming that rank (``rank 1: num_topk must be ...``; it travels in the underlying Buffer's set-up exchange,
            as :class:`~triton_ep.Buffer`'s own bad arguments do), or as :class:`~triton_ep.Buffer`.
    """

    def __init__(self, group=None, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, device=None, rdma_backend: Optional[str] = None) -> None:
        try:            # a rejection here travels in Buffer's set-up exchange: every rank raises it at once
            num_bytes, error = self._checked_size(group, num_bytes, num_cpu_bytes=num_cpu_bytes,
                                                  num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                                  num_topk=num_topk, sl_idx=sl_idx,
                                                  num_allocated_qps=num_allocated_qps), None
        except (TypeError, ValueError) as ex:
            num_bytes, error = 0, ex
        self.group = group
        self._number = next(_BUFFER_NUMBERS)
        try:
            self._buffer = Buffer(group, num_bytes, timeout_s=num_gpu_timeout_secs, device=device,
                                  rdma_backend=rdma_backend, explicitly_destroy=explicitly_destroy, _args_error=error)
        except (TypeError, ValueError) as ex:     # Buffer's set-up checks name V1's arguments: name V2's
            raise (TypeError if isinstance(ex, TypeError) else ValueError)(v2_names(str(ex))) from ex
        b = self._buffer
        self.rank_idx, self.num_ranks, self.device = b.rank, b.group_size, b.device
        self.num_bytes, self.num_cpu_bytes = int(num_bytes), int(num_cpu_bytes)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.hidden, self.num_topk, self.use_fp8_dispatch = int(hidden), int(num_topk), bool(use_fp8_dispatch)
        self.deterministic, self.allow_hybrid_mode = bool(deterministic), bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_allocated_qps = int(num_allocated_qps) or (65 if self.allow_hybrid_mode else 17)
        num_hosts = int(b.get_rdma_stats()["num_hosts"])
        self.num_rdma_ranks, self.num_nvlink_ranks = num_hosts, self.num_ranks // num_hosts
        # the received rows are grouped by global source rank (V2's direct layout), whatever the hosts
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx

    # ------------------------------------------------------------------ sizes, topology, tuning
    @staticmethod
    def _checked_size(group, num_bytes, **counts) -> int:
        """The constructor's own values checked (``counts``: name to value, each an int in ``[0, 2^31)``, ``hidden``
        among them), and the bytes of the underlying Buffer: ``num_bytes``, else :meth:`_size_hint` of ``hidden``.

        Raises:
            ValueError: ``num_bytes`` neither an int nor ``None`` (as every size argument), a count out of range
                (``hidden`` at most :data:`~triton_ep.runtime.checks.MAX_HIDDEN`), or neither ``num_bytes`` nor
                ``hidden`` given.
        """
        for name, v in counts.items():
            if name == "hidden":
                hidden_count(v)
            else:
                count(name, v)
        if num_bytes is not None and not isint(num_bytes):
            raise ValueError(f"ElasticBuffer: num_bytes must be an int (bytes), got {type(num_bytes).__name__}")
        if num_bytes is not None:
            return int(num_bytes)
        if counts["hidden"] == 0:
            raise ValueError("ElasticBuffer needs num_bytes, or hidden (with num_max_tokens_per_rank) to size it; got "
                             "num_bytes=None and hidden=0")
        import torch.distributed as dist
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        return ElasticBuffer._size_hint(int(counts["hidden"]), size)

    @staticmethod
    def _size_hint(hidden: int, num_ranks: int) -> int:
        cfgs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
        return align(max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in cfgs), BUFFER_ALIGNMENT)

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes for ``ElasticBuffer(group, num_bytes=...)``, a multiple of 2 MiB: the larger of V1's dispatch and
        combine buffer hints for bf16 rows of ``hidden`` (``Config.get_nvl_buffer_size_hint``). It does not grow
        with ``num_max_tokens_per_rank``: transfers larger than the buffer go through it in rounds.

        Raises:
            ValueError: a size is not an int in range (``hidden`` in ``[1, 2^30)``: bf16 rows of ``2 * hidden``
                bytes, an int32 count).
        """
        count("num_max_tokens_per_rank", num_max_tokens_per_rank)
        hidden_count(hidden, 1)
        count("num_topk", num_topk)
        import torch.distributed as dist
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        return ElasticBuffer._size_hint(int(hidden), size)

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: hosts, and ranks per host."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)`` of the layout: always ``(1, R)`` here (received rows are
        grouped by global source rank, V2's direct layout; ``psum_num_recv_tokens_per_scaleup_rank`` has ``R``
        entries)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The SM count V2 would pick: here :attr:`Buffer.num_sms` (even, at least 4); results never depend on it.

        Raises:
            ValueError: ``num_experts`` is not a positive multiple of the group size, or ``num_topk`` not an int.
        """
        if not isint(num_experts) or num_experts <= 0 or num_experts % self.num_ranks:
            raise ValueError(f"num_experts must be a positive multiple of the group size {self.num_ranks}, "
                             f"got {num_experts!r}")
        count("num_topk", num_topk)
        return max(4, align(Buffer.num_sms, 2))

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """The QP count V2 would pick for ``num_sms`` (its formula, capped by ``num_allocated_qps``); accepted by
        ``dispatch`` / ``combine``, never used (the RDMA QPs per peer are ``TRITON_EP_RDMA_QPS_PER_PEER``)."""
        n = count("num_sms", num_sms)
        return min(n * 16 + 1 if self.allow_hybrid_mode else min(n, 9), self.num_allocated_qps)

    @staticmethod
    def capture() -> EventHandle:
        """An :class:`EventHandle` recorded on the current CUDA stream (V2's; its ``event`` is ``None`` on CPU), for
        ``previous_event``."""
        return EventHandle()

    def get_comm_stream(self):
        """The communication stream (``None`` on CPU): calls with ``async_with_compute_stream`` run there."""
        return self._buffer.get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Meet every rank of the group: a dispatch of no tokens through the Buffer, named a barrier in its call card
        (collective, bounded by ``num_gpu_timeout_secs``); ``with_cpu_sync``: the device is synchronised before and
        after. ``use_comm_stream`` and ``sequential`` are accepted.

        Raises:
            ValueError: a peer made another call meanwhile (a dispatch, a combine), on every rank alike, naming both
                calls (``the operation: rank 0 called barrier, rank 1 called dispatch``); the next call of every rank
                re-synchronises the group. EPTimeoutError: a rank did not come within the bound. EPError: destroyed.
        """
        sync = with_cpu_sync and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        self._buffer._barrier()
        if sync:
            torch.cuda.synchronize(self.device)

    def destroy(self) -> None:
        """Release the shared buffers at once, whatever the caller keeps (:meth:`triton_ep.Buffer.destroy`;
        idempotent; later calls and event waits raise ``EPError``)."""
        self._buffer.destroy()

    def check(self) -> None:
        """Raise what the Buffer's kernels recorded since the last check (:meth:`triton_ep.Buffer.check`)."""
        self._buffer.check()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: XLike, topk_idx: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token to every rank holding one of its experts (collective), in V2's layouts.

        Args:
            x: ``[T, H]`` rows (bf16, or any dtype whose row is a multiple of 16 bytes: they move bit for bit), or
                ``(x, sf)``: 1-byte rows (fp8 e4m3) and ``[T, S]`` 4-byte scales (fp32 or packed UE8M0 int32).
                ``T <= num_max_tokens_per_rank``; ``T`` may be 0.
            topk_idx: int64 (or int32) ``[T, K]`` global expert ids, ``-1`` none; required unless ``handle``, and
                ``None`` with one. topk_weights: fp32 ``[T, K]`` or ``None``.
            cumulative_local_expert_recv_stats: int32 ``[E_l]`` on the device: this call's received (unaligned)
                per-expert counts are added to it.
            num_experts: ``E``, a multiple of ``R`` (from ``handle`` if ``None``).
            num_max_tokens_per_rank: per-rank token bound (default: the constructor's, or the handle's).
            expert_alignment: each local expert's count rounded up to a multiple of it (default 1, or the handle's).
            num_sms, num_qps: accepted, never used. previous_event: an event (``capture()``) waited for first;
                previous_event_before_epilogue: one waited for before the expanded layout is written.
            async_with_compute_stream: run on the communication stream and return an event (the caller's stream
                does not wait); allocate_on_comm_stream: outputs are allocated there.
            handle: an :class:`EPHandle` of this buffer: a cached dispatch (same routing, new ``x``; no host wait).
            do_cpu_sync: wait on the host for the exact counts (default ``True``, ``False`` with a handle). Without
                it the outputs have the worst-case rows, every rank must pass the same, and the call is capturable.
            do_expand: the expanded layout; with a handle, the handle's (``ValueError`` otherwise, where V2 checks
                nothing: docs/api_v1_v2.md item 15). A cached dispatch's ``x`` may change hidden size or dtype.
            do_handle_copy, do_zero_padding, use_tma_aligned_col_major_sf: V2's, as docs/api_v1_v2.md lists them.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` like ``x`` (a pair for a pair);
            non-expanded: ``[N, H]`` rows, ``recv_topk_idx`` ``[N, K]`` local ids (``-1`` elsewhere), weights fp32
            ``[N, K]`` (0 where the id is ``-1``); expanded: ``[num_expanded_tokens, H]`` rows, ids ``None``, weights
            fp32 ``[num_expanded_tokens]``. Padding rows (worst case, alignment gaps): x 0, scales 0, ids ``-1``,
            weights 0 (``None`` without ``topk_weights``). The handle: a new :class:`EPHandle`, or ``handle`` (cached).
            ``event`` holds an event only with ``async_with_compute_stream``.

        Raises:
            TypeError/ValueError: bad arguments (before anything launches), or as :meth:`triton_ep.Buffer.dispatch`.
            As with Buffer's own checks, the peers' call raises ``EPRemoteError`` at once, and the next call of
            every rank re-synchronises the group. EPTimeoutError, EPRemoteError: as there.
        """
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        with self._agreed("dispatch" if handle is None else "cached", handle, 0 if sync else 1):
            T, order = check_call(x, num_sms, num_qps, do_expand, do_zero_padding, previous_event,
                                        previous_event_before_epilogue, async_with_compute_stream,
                                        allocate_on_comm_stream)
            if handle is not None:
                check_cached(self, T, handle, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                   num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand)
            else:
                plan = check_dispatch(self, T, topk_idx, cumulative_local_expert_recv_stats, num_experts,
                                            num_max_tokens_per_rank, expert_alignment, sync, do_expand)
        if handle is not None:
            return self._cached_dispatch(x, T, handle, topk_weights, cumulative_local_expert_recv_stats, order,
                                         do_expand, use_tma_aligned_col_major_sf)
        return self._fresh_dispatch(x, topk_idx, topk_weights, plan, order, do_handle_copy, int(num_sms),
                                    cumulative_local_expert_recv_stats, use_tma_aligned_col_major_sf)

    def _fresh_dispatch(self, x: XLike, topk_idx: Tensor, topk_weights: Optional[Tensor], plan: DispatchPlan,
                        order: Order, copy_idx: bool, num_sms: int, stats: Optional[Tensor], col_major_sf: bool):
        """A dispatch without a handle, its arguments checked: Buffer's layout and dispatch (with
        ``num_worst_tokens = R * num_max`` without a host wait), then this rank's epilogue (the handle, the
        expanded layout) on :meth:`_epilogue_stream`. Returns :meth:`dispatch`'s tuple."""
        b, async_ = self._buffer, order.async_
        per_rank, per_host, per_expert, in_rank, _ = b.get_dispatch_layout(topk_idx, plan.num_experts,
                                                                           previous_event=order.previous_event)
        recv_x, recv_idx, recv_w, lst, h1, _ = b.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            expert_alignment=plan.alignment, num_worst_tokens=0 if plan.sync else self.num_ranks * plan.num_max,
            async_finish=async_, allocate_on_comm_stream=order.alloc_comm)
        with self._epilogue_stream(async_, order.before_epilogue):
            handle, exp = self._new_handle(plan, topk_idx.clone() if copy_idx else topk_idx, recv_idx, lst, h1,
                                           num_sms, stats)
            out = self._outputs(recv_x, recv_idx, recv_w, handle, exp, col_major_sf)
            event = self._event(async_)
        return (*out, handle, event)

    def _new_handle(self, plan: DispatchPlan, topk_idx: Tensor, recv_idx: Tensor, lst: List[int], h1: tuple,
                    num_sms: int, stats: Optional[Tensor]) -> Tuple[EPHandle, Optional[Expansion]]:
        """The :class:`EPHandle` of a dispatch without a handle, from the underlying Buffer dispatch's results
        (``recv_idx`` ``[N, K]`` local ids, ``lst`` its per-expert list, ``h1`` its handle), and the expanded layout
        (``None`` unless ``plan.expand``). Device work only; adds the unaligned counts to ``stats``."""
        El, al, R, N_max = plan.num_local_experts, plan.alignment, self.num_ranks, plan.num_max
        if plan.sync:
            num_expanded = sum(lst)
        else:
            per_row = plan.num_topk if El < plan.num_topk else min(plan.num_topk, El)   # (room for duplicate ids)
            num_expanded = align(R * N_max * per_row + (al - 1) * El, al)
        unaligned = unaligned_counts(recv_idx, El)
        exp = expansion(recv_idx, unaligned, al, num_expanded) if plan.expand else None
        aligned = (unaligned + al - 1) // al * al
        if plan.expand:
            psum_e = (torch.cumsum(aligned, 0) - aligned + unaligned).to(torch.int32)
        else:
            psum_e = torch.cumsum(aligned, 0).to(torch.int32)
        psum_r = psum_per_rank(h1, self.rank_idx)
        meta = src_metadata(h1, psum_r, recv_idx, N_max, exp.slots if plan.expand else None)
        if stats is not None:
            stats.add_(unaligned.to(torch.int32))
        handle = EPHandle(
            do_expand=plan.expand, num_experts=plan.num_experts, expert_alignment=al, num_max_tokens_per_rank=N_max,
            num_sms=num_sms, topk_idx=topk_idx, num_recv_tokens=int(recv_idx.shape[0]),
            num_expanded_tokens=int(num_expanded), num_recv_tokens_per_expert_list=list(lst) if plan.sync else [],
            psum_num_recv_tokens_per_scaleup_rank=psum_r, psum_num_recv_tokens_per_expert=psum_e,
            num_unaligned_recv_tokens_per_expert=unaligned.to(torch.int32), recv_src_metadata=meta,
            buffer_handle=h1, recv_topk_idx=recv_idx.clone(), owner=self._number)
        return handle, exp

    def _cached_dispatch(self, x, T, handle, topk_weights, stats, order: Order, do_expand, col_major_sf):
        """A dispatch with ``handle``, its arguments checked: Buffer's cached dispatch of ``x`` (and of the weights as
        rows of their own), then this rank's epilogue from the handle's tables. Returns :meth:`dispatch`'s tuple."""
        K = handle.topk_idx.shape[1]
        b, h1 = self._buffer, handle.buffer_handle
        async_, alloc_comm = order.async_, order.alloc_comm
        recv_x = b.dispatch(x, handle=h1, previous_event=order.previous_event, async_finish=async_,
                            allocate_on_comm_stream=alloc_comm)[0]
        recv_w = None
        if topk_weights is not None:        # the weights travel as rows of their own (16-byte rows: K padded to 4)
            Kp = align(K, 4)
            wrows = torch.zeros((T, Kp), dtype=torch.float32, device=self.device)
            wrows[:, :K] = topk_weights
            recv_w = b.dispatch(wrows, handle=h1, async_finish=async_, allocate_on_comm_stream=alloc_comm)[0][:, :K]
        with self._epilogue_stream(async_, order.before_epilogue):
            recv_idx = handle.recv_topk_idx
            if recv_w is not None:
                recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w)).contiguous()
            if stats is not None:
                stats.add_(handle.num_unaligned_recv_tokens_per_expert)
            exp = None
            if do_expand:
                slots = handle.recv_src_metadata[:, 2:].long()
                rows = handle.num_expanded_tokens
                exp = Expansion(slots, *sources(slots, rows))
            out = self._outputs(recv_x, recv_idx.clone(), recv_w, handle, exp, col_major_sf, expand=do_expand)
            event = self._event(async_)
        return (*out, handle, event)

    def _outputs(self, recv_x, recv_idx, recv_w, handle: EPHandle, exp: Optional[Expansion], col_major_sf: bool,
                 expand: Optional[bool] = None):
        """``(recv_x, recv_topk_idx, recv_topk_weights)`` in the layout asked for."""
        expand = handle.do_expand if expand is None else expand
        rows, sf = (recv_x if isinstance(recv_x, tuple) else (recv_x, None))
        if expand:
            n = handle.num_expanded_tokens
            rows = gather_rows(rows, exp.src_row)
            sf = None if sf is None else gather_rows(sf, exp.src_row)
            if recv_w is not None:
                recv_w = gather_rows(recv_w.reshape(-1, 1), exp.src_entry).reshape(n)
            recv_idx = None
        if sf is not None and col_major_sf:
            sf = col_major(sf)
        return ((rows, sf) if sf is not None else rows), recv_idx, recv_w

    # ------------------------------------------------------------------ combine
    def combine(self, x: Tensor, handle: EPHandle, topk_weights: Optional[Tensor] = None,
                bias: Union[None, Tensor, Tuple[Tensor, Tensor]] = None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Return each row along its route and sum per source token (collective).

        Args:
            x: bf16 rows in the dispatch's layout: non-expanded ``[N, H]`` (one per received token, its experts'
                outputs already reduced by the caller), expanded ``[num_expanded_tokens, H]`` (one per (token, local
                expert)). Padding rows are ignored. No weights are applied.
            handle: the :class:`EPHandle` of the dispatch (of this buffer).
            topk_weights: fp32, non-expanded ``[N, K]``, expanded ``[num_expanded_tokens]``: returned per top-k slot.
            bias: ``None``, a bf16 ``[T, H]`` tensor or a pair of them, added to the sum.
            num_sms, num_qps: accepted, never used. previous_event, previous_event_before_epilogue,
            async_with_compute_stream, allocate_on_comm_stream: as in :meth:`dispatch`.

        Returns:
            ``(combined_x bf16 [T, H], combined_topk_weights fp32 [T, K] or None, event)``. Expanded: each rank first
            sums, in fp32 in top-k order, the rows of each of its tokens and rounds that to bf16; then, as
            non-expanded, the source sums over ranks in fp32 in ascending rank order (across hosts: per host, then
            over hosts, as :meth:`triton_ep.Buffer.combine`), adds the biases and rounds once.
            ``combined_topk_weights[t, k]``: the weight the rank holding expert ``topk_idx[t, k]`` returned for slot
            ``k`` (0 where the id is ``-1``).

        Raises:
            TypeError/ValueError: bad arguments or a handle of another buffer (before anything launches; the peers'
            call raises ``EPRemoteError``, as in :meth:`dispatch`), or as :meth:`triton_ep.Buffer.combine`;
            EPTimeoutError, EPRemoteError: as there.
        """
        with self._agreed("combine", handle):
            prev, prev_epi, *_ = check_combine(self, x, handle, topk_weights, bias, num_sms, num_qps,
                                                       previous_event, previous_event_before_epilogue)
        if prev is not None:
            prev.current_stream_wait()
        recv_idx = handle.recv_topk_idx
        if handle.do_expand:
            y, w = reduce_expanded(x, handle.recv_src_metadata[:, 2:].long(), topk_weights)
        else:
            y = x
            w = None if topk_weights is None else torch.where(recv_idx >= 0, topk_weights,
                                                              torch.zeros_like(topk_weights))
        if prev_epi is not None:
            prev_epi.current_stream_wait()
        return self._buffer.combine(y, handle.buffer_handle, topk_weights=w, bias=bias,
                                    async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _agreed(self, call: str, handle=None, num_worst_tokens: int = 0):
        """Run ElasticBuffer's own checks of a collective ``call`` (``"dispatch"``, ``"cached"`` or ``"combine"``) so
        that a rejection reaches the peers as :class:`~triton_ep.Buffer`'s own checks do. Where a check raises
        ``TypeError`` / ``ValueError``, this rank first makes the Buffer call the peers are making (the same kind: a
        dispatch with or without ``handle``, with ``num_worst_tokens`` or not, or a combine) with ``x=None``, which
        Buffer's argument check rejects: that call counts as this rank's part of the collective, and Buffer tells
        the peers (its failure word: their pending call raises ``EPRemoteError`` at once; across hosts the RDMA
        peers hear it in the header exchange). So no peer's pending call pairs with this rank's next call, and the
        next call of every rank re-synchronises the group first. Then the check's own error is raised here."""
        try:
            yield
        except (TypeError, ValueError):
            b = self._buffer
            h1 = handle.buffer_handle if isinstance(handle, EPHandle) and handle.buffer_handle else _NOT_A_HANDLE
            try:
                if call == "combine":
                    b.combine(None, h1)
                else:
                    b.dispatch(None, handle=h1 if call == "cached" else None, num_worst_tokens=num_worst_tokens)
            except Exception:  # noqa: BLE001 - Buffer's rejection of x=None (or an earlier failure it reports): the
                pass           # caller gets this rank's own error
            raise

    @contextlib.contextmanager
    def _epilogue_stream(self, async_: bool, prev_epi: Optional[EventOverlap]):
        """The stream the local work after a call runs on: the communication stream with ``async_`` (after the
        call's kernels there), else the caller's; after ``prev_epi``."""
        comm = self._buffer.get_comm_stream()
        ctx = torch.cuda.stream(comm) if (async_ and comm is not None) else contextlib.nullcontext()
        with ctx:
            if prev_epi is not None:
                prev_epi.current_stream_wait()
            yield

    def _event(self, async_: bool) -> EventOverlap:
        comm = self._buffer.get_comm_stream()
        if not async_ or comm is None:
            return EventOverlap(None, check=self._buffer.check)
        ev = torch.cuda.Event()
        ev.record(comm)
        return EventOverlap(ev, check=self._buffer.check)

    # ------------------------------------------------------------------ V2's other primitives (not served)
    get_engram_storage_size_hint = staticmethod(_primitive("get_engram_storage_size_hint", "Engram"))
    get_pp_buffer_size_hint = staticmethod(_primitive("get_pp_buffer_size_hint", "pipeline-parallel send/recv"))
    get_agrs_num_max_session_bytes = staticmethod(_primitive("get_agrs_num_max_session_bytes", "AGRS"))
    get_agrs_buffer_size_hint = staticmethod(_primitive("get_agrs_buffer_size_hint", "AGRS"))
    engram_write = _primitive("engram_write", "Engram")
    engram_fetch = _primitive("engram_fetch", "Engram")
    pp_set_config = _primitive("pp_set_config", "pipeline-parallel send/recv")
    pp_send = _primitive("pp_send", "pipeline-parallel send/recv")
    pp_recv = _primitive("pp_recv", "pipeline-parallel send/recv")
    create_agrs_session = _primitive("create_agrs_session", "AGRS")
    destroy_agrs_session = _primitive("destroy_agrs_session", "AGRS")
    agrs_new_session = _primitive("agrs_new_session", "AGRS")
    agrs_set_config = _primitive("agrs_set_config", "AGRS")
    agrs_get_inplace_tensor = _primitive("agrs_get_inplace_tensor", "AGRS")
    all_gather = _primitive("all_gather", "AGRS")
