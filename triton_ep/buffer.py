"""``Buffer``: DeepEP V1's ``deep_ep.Buffer``, the face of triton-ep.

The constructor builds the runtime every mode shares (:func:`triton_ep.runtime.open_runtime`) and chooses the
modes once (:func:`triton_ep.modes.choice.open_modes`): normal mode within one host or across hosts, low-latency
mode within one host, across hosts or none. Each method is its docstring and one call to its mode. The whole
contract of each method is docs/api.md; errors follow docs/design.md section 4.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch

from .config import (COMBINE_CONFIGS, DISPATCH_CONFIGS, NUM_SMS_SET, Config, EventOverlap, num_sms_arg,
                     recommended_config)
from .modes.choice import Modes, open_modes
from .modes.internode import Internode
from .modes.intranode import Intranode
from .modes.intranode_args import BARRIER, DispatchArgs, DispatchHandle, XLike
from .modes.low_latency import LowLatency, Unavailable, size_hint
from .runtime import current_event, open_runtime
from .runtime.checks import isint
from . import tuned

Tensor = torch.Tensor


def _shape_arg(name: str, value, least: int) -> Optional[int]:
    """``get_*_config``'s ``hidden`` / ``num_tokens``: ``None`` or an int (not a bool) of at least ``least``.

    Raises:
        ValueError: not an int (a bool, float, str...: as every size argument,
            :func:`~triton_ep.runtime.checks.int_arg`) or less than ``least``, naming ``name`` and the value.
    """
    if value is None:
        return None
    if not isint(value):
        raise ValueError(f"{name} must be None or an int of at least {least}, got {value!r} "
                        f"({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} must be None or an int of at least {least}, got {value!r}")
    return int(value)


def _config(call: str, num_ranks: int, table: dict, hidden: Optional[int], num_tokens: Optional[int]) -> Config:
    """``Buffer.get_dispatch_config`` / ``get_combine_config``: the tuned table's Config, else the built-in one."""
    builtin = recommended_config(num_ranks, table, Buffer.num_sms)        # (checks num_ranks)
    hidden, num_tokens = _shape_arg("hidden", hidden, 1), _shape_arg("num_tokens", num_tokens, 0)
    loaded = tuned.load()
    got = loaded.config(call, int(num_ranks), hidden, num_tokens) if loaded is not None else None
    if got is None:
        return builtin
    if NUM_SMS_SET.value is not None:
        f = got.fields()
        warps = f.pop("num_warps")
        got = Config(**dict(f, num_sms=NUM_SMS_SET.value), num_warps=warps)
    return got


#: the error of ``Buffer.runtime``: DeepEP's C++ runtime object has no counterpart here; what its getters answer
RUNTIME_ABSENT = ("triton_ep.Buffer has no 'runtime': DeepEP's is its C++ object, which vLLM and SGLang do not use. "
                  "Its getters here: get_num_rdma_ranks() is buffer.get_rdma_stats()['num_hosts'], "
                  "get_local_device_id() is buffer.device.index (None on CPU); the rank and group size are "
                  "buffer.rank and buffer.group_size")

__all__ = ["Buffer", "DispatchArgs", "DispatchHandle", "RUNTIME_ABSENT"]


class Buffer:
    """Expert-parallel communication buffer, DeepEP V1's ``deep_ep.Buffer``: normal and low-latency mode, within
    one host and across hosts (docs/api.md has every argument; docs/internode.md, docs/low_latency.md).

    Args:
        group: the EP process group (gloo or NCCL; ``None``: the default group), used only to bootstrap.
        num_nvl_bytes: int in ``[0, 2^62]``, bytes of this rank's intranode buffer (rounded up to a multiple
            of 4 KiB, at least 4 KiB).
        num_rdma_bytes: int in ``[0, 2^62]``, bytes of the low-latency area (with ``low_latency_mode``).
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric,
            explicitly_destroy, enable_shrink, comm: DeepEP's; those that do not apply are ignored.
        timeout_s: seconds, in ``[1e-9, 1e9]``, bound on every wait for a peer (default 100 or
            ``TRITON_EP_TIMEOUT_S``). device: default the current CUDA device, else CPU.
        rdma_backend: ``"auto"``, ``"verbs"``, ``"emulated"`` or ``None`` (``TRITON_EP_RDMA``, else ``"auto"``).
        _args_error: not for callers: the ``ValueError`` / ``TypeError`` a face built over Buffer
            (:class:`~triton_ep.ElasticBuffer`) found in its own arguments on this rank, raised on every rank at once
            as a bad argument of Buffer's own is (``None``: none).

    Raises:
        ValueError/TypeError: a bad argument or environment value on any rank (on every rank at once), ranks that
            disagree, hosts of different sizes, several hosts and no RDMA transport.
        EPTimeoutError: a rank did not join within ``timeout_s``. EPRemoteError: a peer failed to build its Buffer.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, timeout_s: Optional[float] = None,
                 device: Optional[Union[str, torch.device]] = None, rdma_backend: Optional[str] = None,
                 _args_error: Optional[Exception] = None, **unused) -> None:
        if unused:
            warnings.warn(f"triton_ep.Buffer ignores unknown arguments {sorted(unused)}", stacklevel=2)
        self._rt = rt = open_runtime(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, timeout_s, device,
                                     rdma_backend, args_error=_args_error)
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.group, self.timeout_s, self.rank, self.group_size, self.device = \
            rt.group, rt.timeout_s, rt.rank, rt.group_size, rt.device
        self._modes: Modes = open_modes(rt, low_latency_mode, self.num_rdma_bytes, num_qps_per_rank, enable_shrink,
                                        allow_nvlink_for_low_latency_mode)
        #: normal mode (within one host or across hosts) and low-latency mode (or none), chosen once
        self._normal: Union[Intranode, Internode] = self._modes.normal
        self._ll: Union[LowLatency, Unavailable] = self._modes.low_latency

    # ------------------------------------------------------------------ static, DeepEP-compatible helpers
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count (DeepEP's): the ``num_sms`` of the Configs ``get_dispatch_config`` and
        ``get_combine_config`` return, and the SM bound of normal-mode calls made without a Config from now on
        (docs/tuning.md); results never depend on it.

        Raises:
            ValueError: not an even int in ``[2, 2^31 - 2]``.
        """
        Buffer.num_sms = NUM_SMS_SET.value = num_sms_arg(new_num_sms)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the current CUDA device is SM90 (Hopper) or newer (DeepEP's; kernels are JIT-compiled)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (DeepEP's; ``EventOverlap(None)`` on CPU)."""
        return current_event()

    @staticmethod
    def get_dispatch_config(num_ranks: int, hidden: Optional[int] = None, num_tokens: Optional[int] = None) -> Config:
        """The dispatch Config for ``num_ranks`` (any ``R >= 1``): the tuned table's when one is loaded for this GPU
        and ``R`` (``python -m triton_ep tune``, docs/tuning.md; ``hidden`` and ``num_tokens``, triton-ep's keywords,
        pick among its shapes), else DeepEP's recommendation with ``Buffer.num_sms``. After ``set_num_sms`` a tuned
        Config carries that SM count. ``hidden``: ``None`` or an int of at least 1; ``num_tokens``: ``None`` or an
        int of at least 0 (a rank may have no tokens).

        Raises:
            ValueError: ``num_ranks`` not a positive int; ``hidden`` or ``num_tokens`` not an int (a bool, float or
                str), ``hidden < 1`` or ``num_tokens < 0``, naming it and the value.
        """
        return _config("dispatch", num_ranks, DISPATCH_CONFIGS, hidden, num_tokens)

    @staticmethod
    def get_combine_config(num_ranks: int, hidden: Optional[int] = None, num_tokens: Optional[int] = None) -> Config:
        """The combine Config for ``num_ranks``, as :meth:`get_dispatch_config` (the tuned table's combine entries).

        Raises:
            ValueError: as :meth:`get_dispatch_config`.
        """
        return _config("combine", num_ranks, COMBINE_CONFIGS, hidden, num_tokens)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` low-latency mode needs for these sizes, a multiple of 128 (DeepEP's).

        Raises:
            ValueError: a size not an int in ``[1, 2^31 - 1]`` (``num_experts`` at most ``MAX_EXPERTS``),
                ``num_experts % num_ranks != 0`` or ``hidden % 8 != 0``, naming the argument.
        """
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """A view of this rank's raw intranode buffer as ``dtype`` from element ``offset``, reshaped to ``size``
        (DeepEP's); its contents change with every call, so it is never a call's input (the call's traffic would
        overwrite it as it is read, unchecked: docs/api.md). With ``use_rdma_buffer``: as many ``dtype`` elements
        as the RDMA-side memory has, views of one scratch element that no call reads (docs/api.md: zeroing it, as
        vLLM does, changes nothing).

        Raises:
            ValueError: ``offset`` not an int, negative or past the end; ``size`` not a sequence of ints, or too
                large. TypeError: ``dtype`` not a ``torch.dtype``. EPError: destroyed.
        """
        return self._modes.local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def get_comm_stream(self):
        """The communication stream (DeepEP's; ``None`` on CPU): where calls with ``async_finish`` run."""
        return self._rt.comm_stream

    def internode_dispatch(self, *args, **kwargs):
        """DeepEP's ``internode_dispatch``: ``dispatch`` on a Buffer whose ranks span hosts.

        Raises:
            ValueError: this Buffer's ranks are on one host (call ``dispatch``); otherwise as ``dispatch``.
        """
        return self._normal.internode_dispatch(*args, **kwargs)

    def internode_combine(self, *args, **kwargs):
        """DeepEP's ``internode_combine``: ``combine`` on a Buffer whose ranks span hosts.

        Raises:
            ValueError: this Buffer's ranks are on one host (call ``combine``); otherwise as ``combine``.
        """
        return self._normal.internode_combine(*args, **kwargs)

    # ------------------------------------------------------------------ low-latency mode (docs/low_latency.md)
    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each token to each of its experts, received expert-major (collective; DeepEP V1's). No host
        synchronisation: it captures in a CUDA graph.

        Args:
            x: bf16 ``[T, H]``, ``T <= N`` (``num_max_dispatch_tokens_per_rank``), ``H % 8 == 0`` (FP8:
                ``H % 128 == 0``). topk_idx: int64 (or int32) ``[T, K]``, ``-1`` = none. num_experts: ``E``.
            cumulative_local_expert_recv_stats: int32 ``[E/R]`` or ``None``; dispatch_wait_recv_cost_stats: int64
                ``[R]`` or ``[R, R]`` nanoseconds, or ``None``. use_fp8, round_scale, use_ue8m0, async_finish,
                return_recv_hook: DeepEP's flags.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` bf16 ``[E/R, R*N, H]`` or with FP8 ``(fp8 e4m3
            [E/R, R*N, H], scales fp32 [E/R, R*N, H/128] or UE8M0 int32 [E/R, R*N, H/512])``; ``recv_count`` int32
            ``[E/R]``; ``handle`` DeepEP's tuple; ``hook`` or ``None``.

        Raises:
            TypeError/ValueError: bad arguments, before any launch. EPTimeoutError, EPRemoteError: a peer did not
            arrive or failed. EPError: destroyed.
        """
        return self._ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                 round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[Tensor] = None):
        """Return expert outputs to their tokens and reduce them with the weights (collective; DeepEP V1's). No
        host synchronisation: it captures in a CUDA graph.

        Args:
            x: bf16 ``[E/R, R*N, H]``. topk_idx, topk_weights: the dispatch's ``[T, K]`` ids and fp32 weights.
            handle: the matching ``low_latency_dispatch``'s. use_logfmt (``H % 128 == 0``), zero_copy,
            async_finish, return_recv_hook: DeepEP's flags. out: optional bf16 ``[T, H]``.
            combine_wait_recv_cost_stats: int64 ``[R]`` or ``[R, R]`` nanoseconds, or ``None``.

        Returns:
            ``(combined_x bf16 [T, H], event, hook)``: per token ``sum_k w[t, k] * row(t, k)`` in fp32, rounded once.

        Raises:
            TypeError/ValueError, NotImplementedError, EPTimeoutError, EPRemoteError, EPError: as in dispatch.
        """
        return self._ll.combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> Tensor:
        """The bf16 ``[E/R, R*N, H]`` tensor to write expert outputs into for ``low_latency_combine(...,
        zero_copy=True)`` (DeepEP's).

        Raises:
            TypeError/ValueError: not a low-latency handle of this Buffer.
        """
        return self._ll.next_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's buffer cleaning: checks the sizes fit and, after an error, re-synchronises the group (collective).

        Raises:
            ValueError: sizes that do not fit ``num_rdma_bytes``.
        """
        self._ll.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank for this rank's low-latency calls (DeepEP's, with
        ``enable_shrink``); across hosts unmasking is collective.

        Raises:
            ValueError: no ``enable_shrink``, a bad rank, or (across hosts) ranks that made different calls.
            EPTimeoutError: across hosts, a rank did not come within ``timeout_s``.
        """
        self._ll.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: Tensor) -> None:
        """Write 1 for each masked rank, else 0, into ``mask_status`` (int32 ``[R]``; DeepEP's).

        Raises:
            ValueError: no ``enable_shrink``, or ``mask_status`` not int32 ``[R]``.
        """
        self._ll.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (DeepEP's ``clean_mask_buffer``); across hosts a collective call.

        Raises:
            ValueError: no ``enable_shrink``, or (across hosts) ranks that made different calls.
            EPTimeoutError: across hosts, as ``low_latency_update_mask_buffer``.
        """
        self._ll.clean_mask()

    def get_rdma_stats(self) -> dict:
        """Traffic between hosts since construction, bytes and seconds per QP, port and channel (triton-ep's own,
        not in DeepEP; docs/api.md names every key).

        Raises:
            EPError: the Buffer was destroyed.
        """
        return self._modes.rdma_stats()

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release this rank's shared buffers, peer mappings and (across hosts) RDMA resources (DeepEP's) by the
        time it returns, whatever the caller keeps (events, handles, hooks, results, this object; not the views
        ``get_local_buffer_tensor`` and ``get_next_low_latency_combine_buffer`` gave), with no garbage collection
        (on a CPU, Triton's interpreter keeps this rank's own buffer in reference cycles of its own until the next
        collection). Idempotent; later calls, event waits and hooks raise ``EPError``. In a process forked from the
        one that built the Buffer it does nothing (they are the parent's)."""
        self._modes.close()

    def check(self) -> None:
        """Raise what this Buffer's kernels, RDMA proxies and peers recorded since the last check, each error once
        (across hosts a network-leg error at every check). Reads host memory only.

        Raises:
            EPTimeoutError, EPRemoteError, EPCapacityError, ValueError: as recorded. EPError: destroyed.
        """
        self._modes.check()

    def __enter__(self) -> "Buffer":
        return self

    def __getattr__(self, name: str):
        """Only for attributes that do not exist (Python calls it after the normal look-up failed): DeepEP's
        ``runtime`` (its C++ object, not part of its Python API; vLLM and SGLang do not touch it, scripts read
        getters on it) gets an ``AttributeError`` that says what to use here; any other name Python's own.
        """
        if name == "runtime":
            raise AttributeError(RUNTIME_ABSENT, name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.destroy()

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """The routing layout of this rank's tokens (local, no communication; DeepEP's).

        Args:
            topk_idx: int64 (or int32) ``[T, K]``, ``-1`` = none, ``K >= 1``. num_experts: ``E``, a positive multiple
                of ``R``, at most ``MAX_EXPERTS`` (16384).

        Returns:
            ``num_tokens_per_rank`` int32 ``[R]``, ``num_tokens_per_rdma_rank`` int32 ``[num_hosts]`` (``None`` on
            one host), ``num_tokens_per_expert`` int32 ``[E]``, ``is_token_in_rank`` bool ``[T, R]``, event.

        Raises:
            TypeError/ValueError: bad dtype, shape, device, ``K == 0``, ``E % R != 0`` or ``E > MAX_EXPERTS``.
        """
        return self._normal.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                allocate_on_comm_stream)

    def dispatch(self, x: XLike, handle: Optional[tuple] = None, num_tokens_per_rank: Optional[Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[Tensor] = None, is_token_in_rank: Optional[Tensor] = None,
                 num_tokens_per_expert: Optional[Tensor] = None, topk_idx: Optional[Tensor] = None,
                 topk_weights: Optional[Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token row to every rank holding one of its experts (collective; DeepEP V1's).

        Args:
            x: ``[T, H]`` of any dtype whose row is a multiple of 16 bytes, or ``(x, scales)``: 1-byte ``[T, H]`` and
                fp32/int32 ``[T, S]``. handle: an earlier dispatch's (same routing, new data).
            num_tokens_per_rank int32 ``[R]``, num_tokens_per_rdma_rank int32 ``[num_hosts]`` (across hosts),
                is_token_in_rank bool ``[T, R]``, num_tokens_per_expert int32 ``[E]``: ``get_dispatch_layout``'s
                (the two counts may also be int64; ``num_tokens_per_rank``'s values are not read, and
                ``num_tokens_per_expert``'s only without ``topk_idx``: docs/api.md).
            topk_idx: int64 (or int32) ``[T, K]``; topk_weights: fp32 ``[T, K]``. expert_alignment,
            num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream: DeepEP's.

        Returns:
            ``(recv_x, recv_topk_idx [N, K], recv_topk_weights fp32 [N, K], num_recv_tokens_per_expert_list,
            handle, event)``; with a handle ``(recv_x, None, None, None, None, event)``.

        Raises:
            TypeError/ValueError: bad arguments (before any kernel runs) or ids outside ``[-1, E)``; the
            allocator's error where outputs of ``num_worst_tokens`` rows do not fit (before the call starts: a
            refused call, the Buffer goes on); EPRemoteError, EPCapacityError (``num_worst_tokens`` too small),
            EPTimeoutError, ProxyError (across hosts) (docs/api.md).
        """
        return self._normal.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                     num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                     num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream)

    def combine(self, x: Tensor, handle: tuple, topk_weights: Optional[Tensor] = None,
                bias: Union[None, Tensor, Tuple[Tensor, ...]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Return rows along the routes of ``handle`` and sum them per source token (collective; DeepEP V1's).

        Args:
            x: bf16 ``[N, H]``. handle: the matching dispatch's. topk_weights: fp32 ``[N, K]`` or ``None`` (``K``:
            the columns of the dispatch's ``topk_idx`` within one host, where it took one, as its
            ``recv_topk_weights``; another width is a ``ValueError`` on that rank and ``EPRemoteError`` on its
            peers). bias: ``None``, bf16 ``[T, H]`` or a tuple of up to two. config, previous_event, async_finish,
            allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            ``(combined_x bf16 [T, H], combined_topk_weights fp32 [T, K] or None, event)``: the fp32 sum in
            ascending rank order plus the biases, rounded once.

        Raises:
            TypeError/ValueError: bad arguments or a handle of another Buffer or shape; EPRemoteError,
            EPTimeoutError, NotImplementedError: as in ``dispatch``.
        """
        return self._normal.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                    allocate_on_comm_stream)

    def _barrier(self) -> None:
        """Not for callers: :meth:`triton_ep.ElasticBuffer.barrier`'s meeting of every rank (collective, bounded by
        ``timeout_s``), a dispatch of no tokens that its signature and call card name as a barrier
        (:data:`triton_ep.protocol.call_card.BARRIER`): a peer that made another call there fails with this rank,
        each told ``the operation: rank 0 called barrier, rank 1 called dispatch``.

        Raises:
            ValueError: a peer made another call (on every rank). EPTimeoutError, EPRemoteError, EPError: as
            ``dispatch``.
        """
        idx = torch.zeros((0, 1), dtype=torch.int64, device=self.device)
        per_rank, per_host, per_expert, in_rank, _ = self.get_dispatch_layout(idx, self.group_size)
        self._normal.dispatch(torch.zeros((0, 8), dtype=torch.bfloat16, device=self.device), None, per_rank, per_host,
                              in_rank, per_expert, operation=BARRIER)
