"""``Buffer``: DeepEP V1's ``deep_ep.Buffer``, the face of triton-ep.

``Buffer`` holds no logic of its own: it builds the group's shared buffers (:mod:`triton_ep.transport.ipc`,
bootstrapped through :mod:`triton_ep.transport.bootstrap`), a :class:`~triton_ep.runtime.Runtime` that every
mode shares, and the modes (:mod:`triton_ep.modes`: ``intranode`` for ``get_dispatch_layout`` / ``dispatch``
/ ``combine``, ``low_latency`` for the ``low_latency_*`` calls); each public method checks nothing itself
and forwards. Errors follow docs/design.md section 4.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch

from .config import Config, EventOverlap
from .modes.internode import Internode, traffic_stats
from .modes.intranode import DispatchArgs, DispatchHandle, Intranode, XLike
from .modes import internode_ll, intranode_replay
from .modes.low_latency import LowLatency, size_hint
from .runtime import open_runtime
from .runtime.context import ll_area_bytes
from .runtime.checks import MAX_EXPERTS, MAX_INT32, int_arg, isint

Tensor = torch.Tensor

__all__ = ["Buffer", "DispatchArgs", "DispatchHandle"]


class Buffer:
    """Expert-parallel communication buffer, a drop-in for DeepEP V1's ``deep_ep.Buffer``: normal mode within
    one host, low-latency mode within one host, and both modes across hosts (their network legs in kernels
    over the RDMA scheduler: docs/internode.md, docs/low_latency.md).

    Args:
        group: the EP process group (any backend: gloo or NCCL; used only to exchange buffer handles).
            ``None`` means the default group.
        num_nvl_bytes: bytes of this rank's intranode buffer, e.g. ``Config.get_nvl_buffer_size_hint``; an int
            in ``[0, 2^62]``. Transfers larger than it go through it in rounds.
        num_rdma_bytes: with ``low_latency_mode``, bytes of the low-latency area
            (``get_low_latency_rdma_size_hint``), mapped by every rank of the host (across hosts: this rank's
            own, plus about twice that of registered host memory for the network leg); else unused. An int in
            ``[0, 2^62]``.
        low_latency_mode: enable the ``low_latency_*`` calls (docs/low_latency.md).
        enable_shrink: allow rank masking in low-latency mode (a peer that times out is masked).
        num_qps_per_rank: RC QPs to each peer of low-latency mode across hosts (DeepEP passes ``E / R``). Not
            used by normal mode: its network leg's QPs per peer are ``TRITON_EP_RDMA_QPS_PER_PEER`` (default 4;
            DeepEP sizes it to its SM channels, one QP each, while here the RDMA proxy spreads chunks over however
            many QPs there are), nor within one host.
        allow_nvlink_for_low_latency_mode: across hosts, low-latency peers on this rank's host are reached
            through the host's shared buffer (NVLink / IPC); ``False``: over RDMA as well. Same results.
        allow_mnnvl, use_fabric, explicitly_destroy, comm: DeepEP's keyword arguments, accepted; those that do
            not apply are ignored.
        timeout_s: bound in seconds on every wait for a peer (default 100, or ``TRITON_EP_TIMEOUT_S``), a number
            in ``(0, 1e9]`` (kernels carry it as int64 nanoseconds).
        device: where buffers and inputs live; default the current CUDA device, else CPU.
        rdma_backend: the transport between hosts: ``"auto"`` (pyverbs on the machine's RDMA devices),
            ``"verbs"`` or ``"emulated"`` (the emulated fabric: one machine standing in for several hosts);
            ``None``: ``TRITON_EP_RDMA``, else ``"auto"``. Ranks are grouped into hosts by host identity,
            or by ``TRITON_EP_RANKS_PER_HOST=n`` (docs/internode.md).

    Raises:
        ValueError: a bad argument value or environment value (``TRITON_EP_TIMEOUT_S``, ``TRITON_EP_SHM_TAG``,
            ``TRITON_EP_RDMA``, ...) on any rank: raised on every rank at once, naming the rank (``TypeError``
            where that rank's error is one); ranks that disagree on ``rdma_backend`` or
            ``TRITON_EP_RANKS_PER_HOST``; hosts of different sizes; a host whose ranks run on several
            machines; several hosts and no RDMA transport.
        EPTimeoutError: a rank did not join within ``timeout_s``.
        EPRemoteError: a peer failed to build its Buffer otherwise (out of memory, say).

    With ``low_latency_mode`` and ranks on several hosts the Buffer serves both the normal-mode calls and the
    low-latency calls across hosts (as DeepEP's one Buffer for both modes); there a timeout or a failed RDMA
    proxy ends its low-latency calls for good, and unmasking a rank reached over the network is a collective
    call (every rank makes it: the group meets and renumbers the rings of the pairs that were masked).
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, timeout_s: Optional[float] = None,
                 device: Optional[Union[str, torch.device]] = None, rdma_backend: Optional[str] = None,
                 **unused) -> None:
        if unused:
            warnings.warn(f"triton_ep.Buffer ignores unknown arguments {sorted(unused)}", stacklevel=2)
        self._rt = rt = open_runtime(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, timeout_s, device,
                                     rdma_backend)
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.group, self.timeout_s, self.rank, self.group_size, self.device = \
            rt.group, rt.timeout_s, rt.rank, rt.group_size, rt.device
        self._intranode = Intranode(rt)
        try:
            ll = (bool(low_latency_mode), int(num_rdma_bytes) if low_latency_mode else 0)
            self._internode = Internode(rt, low_latency=ll) if rt.num_hosts > 1 else None
        except BaseException:
            rt.close()
            raise
        self._ll = LowLatency(rt, rt.ll_offset, rt.ll_bytes, enable_shrink) if rt.ll_bytes else None
        if rt.num_hosts > 1 and low_latency_mode and num_rdma_bytes:
            try:
                self._ll = internode_ll.open_internode_low_latency(
                    rt, ll_area_bytes(num_rdma_bytes), num_qps_per_rank, enable_shrink,
                    bool(allow_nvlink_for_low_latency_mode), delays=self._internode.delays)
            except BaseException:
                try:
                    self._internode.close()
                finally:
                    rt.close()
                raise
        rt.agree_on_layout()

    # ------------------------------------------------------------------ static, DeepEP-compatible helpers
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count DeepEP's configs carry (even, positive). Results never depend on it.

        Raises:
            ValueError: ``new_num_sms`` is not an even int in ``[2, 2^31 - 2]`` (a Config field, an int32).
        """
        if not isint(new_num_sms) or not 0 < new_num_sms <= MAX_INT32 or new_num_sms % 2:
            raise ValueError(f"the SM count must be an even int in [2, {MAX_INT32 - 1}] (a Config field, int32), "
                             f"got {new_num_sms!r}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether SM90 (Hopper) features are available: true when the current CUDA device is SM90 or newer
        (kernels are JIT-compiled for the device in use)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (``EventOverlap(None)`` on CPU)."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        ev = torch.cuda.Event()
        ev.record()
        return EventOverlap(ev)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A recommended dispatch Config for ``num_ranks`` (any ``R >= 1``), DeepEP's values where it has them.

        Raises:
            ValueError: ``num_ranks < 1``.
        """
        return Buffer._config(num_ranks, {2: (24, 256), 4: (6, 256), 8: (6, 256), 16: (16, 288), 24: (8, 288),
                                          32: (8, 288), 64: (20, 288), 128: (20, 560), 144: (32, 720),
                                          160: (28, 720)})

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A recommended combine Config for ``num_ranks`` (any ``R >= 1``), DeepEP's values where it has them.

        Raises:
            ValueError: ``num_ranks < 1``.
        """
        return Buffer._config(num_ranks, {2: (10, 256), 4: (9, 256), 8: (4, 256), 16: (2, 288), 24: (1, 288),
                                          32: (1, 288), 64: (1, 288), 128: (1, 560), 144: (2, 720),
                                          160: (2, 720)})

    @staticmethod
    def _config(num_ranks: int, table: dict) -> Config:
        if not isint(num_ranks) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        key = min((k for k in table if k >= num_ranks), default=max(table))   # next size up
        send, recv = table[key]
        return Config(Buffer.num_sms, send, recv, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` low-latency mode needs for these sizes (DeepEP's function): a control
        block, two halves (each the counts and ``num_experts * num_max_dispatch_tokens_per_rank`` bf16 row
        records; a dispatch or a combine uses one half) and the zero-copy combine input, rounded up to 128
        bytes. Pass it as ``Buffer(..., num_rdma_bytes=hint, low_latency_mode=True)``.

        Raises:
            ValueError: a size is not an int in ``[1, 2^31 - 1]`` (``num_experts``: at most ``MAX_EXPERTS``, what a
                call takes), ``num_experts % num_ranks != 0``, or ``hidden % 8 != 0`` (no low-latency call takes
                such rows: bf16 calls take ``hidden % 8 == 0``, FP8 calls ``hidden % 128 == 0``); the error names the
                argument.
        """
        vals = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        for name, v in zip(("num_max_dispatch_tokens_per_rank", "hidden", "num_ranks"), vals):
            int_arg(name, v, 1, MAX_INT32, "int32 in the kernels")
        int_arg("num_experts", num_experts, 1, MAX_EXPERTS, "the most experts a call takes")
        if num_experts % num_ranks:
            raise ValueError(f"get_low_latency_rdma_size_hint needs num_experts % num_ranks == 0, got {vals}")
        if hidden % 8:
            raise ValueError(f"get_low_latency_rdma_size_hint: hidden {hidden} is not a multiple of 8; low-latency "
                             f"calls move rows of a multiple of 16 bytes (bf16: hidden % 8 == 0; FP8: hidden % 128 == 0)")
        return size_hint(*vals)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """A view of this rank's raw intranode buffer as ``dtype`` (from element ``offset``, optionally
        reshaped to ``size``). Its contents change with every call.

        With ``use_rdma_buffer`` (DeepEP: its NVSHMEM buffer, which callers such as vLLM's fault-tolerance path
        zero to reset it): a tensor of as many ``dtype`` elements as this rank's RDMA-side memory has (across
        hosts the registered rings, else ``num_rdma_bytes``), all of them views of one scratch element (stride
        0) that no call reads. Writing it, ``.zero_()`` included, changes nothing: triton-ep's signal words carry
        call numbers, so there is nothing to reset by zeroing (``clean_low_latency_buffer`` and
        ``low_latency_clean_mask_buffer`` re-synchronise after an error), and zeroing the real rings would wipe
        those numbers. Across hosts ``get_rdma_stats`` reports the rings' traffic.

        Raises:
            ValueError: ``size`` too large. EPError: destroyed.
        """
        if use_rdma_buffer:
            self._rt.live()
            nbytes = self._internode.rdma_buffer().numel() if self._internode is not None else self.num_rdma_bytes
            n = max(nbytes // dtype.itemsize - int(offset), 0)
            shape = torch.Size([n]) if size is None else torch.Size(size)
            if shape.numel() > n:
                raise ValueError(f"size {tuple(shape)} exceeds the RDMA buffer ({n} elements from offset {offset})")
            scratch = torch.zeros(1, dtype=dtype, device=self.device)
            return scratch.as_strided(shape, (0,) * len(shape))
        t = self._rt.live().data.view(dtype)[offset:]
        if size is None:
            return t
        if t.numel() < torch.Size(size).numel():
            raise ValueError(f"size {tuple(size)} exceeds the buffer ({t.numel()} elements from offset {offset})")
        return t[:torch.Size(size).numel()].view(size)

    def get_comm_stream(self):
        """The communication stream (``None`` on CPU), as DeepEP's: a call with ``async_finish`` runs its
        kernels there, after ``previous_event`` or, without one, after the caller's current stream, and
        returns an event on it; the caller's stream does not wait. A call without ``async_finish`` runs
        its kernels on the caller's stream (after ``previous_event``): the order DeepEP's wait-run-wait
        gives, with no cross-stream wait."""
        return self._rt.comm_stream

    def internode_dispatch(self, *args, **kwargs):
        """DeepEP's ``internode_dispatch`` (what its ``dispatch`` calls when ranks span hosts): ``dispatch`` on a
        Buffer whose ranks span several hosts, with the same arguments and results.

        Raises:
            ValueError: this Buffer's ranks are on one host (call ``dispatch``); otherwise as ``dispatch``.
        """
        self._across_hosts("internode_dispatch")
        return self.dispatch(*args, **kwargs)

    def internode_combine(self, *args, **kwargs):
        """DeepEP's ``internode_combine``: ``combine`` on a Buffer whose ranks span several hosts.

        Raises:
            ValueError: this Buffer's ranks are on one host (call ``combine``); otherwise as ``combine``.
        """
        self._across_hosts("internode_combine")
        return self.combine(*args, **kwargs)

    def _across_hosts(self, name: str) -> None:
        if self._internode is None:
            raise ValueError(f"{name}: this Buffer's ranks are all on one host; call "
                             f"{name.replace('internode_', '')}() (it picks the mode)")

    # ------------------------------------------------------------------ low-latency mode (docs/low_latency.md)
    def _low_latency(self) -> LowLatency:
        self._rt.live()
        if self._ll is None:
            raise ValueError("low-latency calls need Buffer(..., num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint"
                             "(...), low_latency_mode=True) built over a process group")
        return self._ll

    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each token to each of its experts, received expert-major (collective; DeepEP V1's
        ``low_latency_dispatch``). No host synchronisation: it captures in a CUDA graph.

        Args:
            x: bf16 ``[T, H]``, ``T <= num_max_dispatch_tokens_per_rank`` (``N``), ``H % 8 == 0`` (rows of a
                multiple of 16 bytes: gpt-oss's 2880 too); with ``use_fp8``, ``H % 128 == 0``.
            topk_idx: int64 (or int32) ``[T, K]`` global expert ids, ``-1`` = none. A duplicate id within a
                token sends the row once. Ids outside ``[-1, E)`` are masked, nothing is sent, and
                ``check()`` raises ``ValueError`` (peers: ``EPRemoteError``).
            num_max_dispatch_tokens_per_rank: ``N``, the same on every rank; num_experts: ``E``.
            cumulative_local_expert_recv_stats: int32 ``[E/R]`` or ``None``: rows received per local expert
                are added to it.
            dispatch_wait_recv_cost_stats: int64 ``[R]`` (or ``[R, R]``: this rank's row) or ``None``:
                nanoseconds spent waiting for each source rank are added to it (GPU clock; stays 0 on CPU,
                where interpreted kernels cannot read a clock).
            use_fp8: cast rows to FP8 e4m3 with one fp32 scale per 128 channels (``x ~= q * scale``);
            round_scale: power-of-two scales; use_ue8m0: scales packed as UE8M0 bytes (needs
                ``round_scale``, ``H % 512 == 0``).
            async_finish: return an event instead of making the caller's stream wait.
            return_recv_hook: only send; the returned ``hook()`` runs the receive (at most two calls
                outstanding).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is bf16 ``[E/R, R*N, H]``, or with FP8
            ``(fp8 e4m3 [E/R, R*N, H], scales)`` where scales are fp32 ``[E/R, R*N, H/128]`` or UE8M0 int32
            ``[E/R, R*N, H/512]``, column-major in their last two dimensions. Rows of each local expert are
            packed by source rank in rank order, each in token order; only the first ``recv_count[e]``
            (int32 ``[E/R]``) rows are valid. ``handle``: ``(src_info int32 [E/R, R*N], layout_range int64
            [E/R, R] (begin << 32 | count), N, H, E)``. ``hook`` is ``None`` without ``return_recv_hook``.

        Raises:
            TypeError/ValueError: bad arguments (before any launch; the peers raise ``EPRemoteError``); sizes
                (``num_max_dispatch_tokens_per_rank``, hidden, ``num_experts``) other than the last low-latency
                call's while a receive hook of this rank is pending (the first call of new sizes waits until
                every peer received the last call).
            EPTimeoutError, EPRemoteError: a peer did not arrive or failed (from ``check()``; with
            ``enable_shrink`` a peer that times out is masked instead).
        """
        return self._low_latency().dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                            use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[Tensor] = None):
        """Return expert outputs to their tokens and reduce them **with** the weights (collective; DeepEP
        V1's ``low_latency_combine``). No host synchronisation: it captures in a CUDA graph.

        Args:
            x: bf16 ``[E/R, R*N, H]``, the expert outputs in ``recv_x``'s order (rows past
                ``recv_count`` are ignored).
            topk_idx, topk_weights: the dispatch's ``[T, K]`` ids and fp32 weights.
            handle: the matching ``low_latency_dispatch``'s handle.
            use_logfmt: the rows travel as DeepEP's LogFMT-10 (``H * 10 / 8 + H / 128 * 4`` bytes a row, against
                ``2 * H``), decoded to fp32 before the same sum: lossy, within DeepEP's accuracy bound
                (docs/low_latency.md); not with ``zero_copy`` (``ValueError``, as DeepEP); needs ``H % 128 == 0``
                (blocks of 128 channels; ``ValueError`` otherwise).
            zero_copy: the expert outputs were written into ``get_next_low_latency_combine_buffer(handle)``
                beforehand; what that buffer holds is combined, and ``x`` (any tensor of the right shape and
                dtype, e.g. the one copied from) is not read (DeepEP's contract).
            async_finish, return_recv_hook: as in ``low_latency_dispatch``.
            out: optional bf16 ``[T, H]`` written in place and returned.
            combine_wait_recv_cost_stats: as ``dispatch_wait_recv_cost_stats``.

        Returns:
            ``(combined_x bf16 [T, H], event, hook)``: per token ``sum_k w[t, k] * x_row(t, k)`` in fp32,
            ascending ``k``, rounded once to bf16 (round to nearest even); entries with id ``-1`` or on a
            masked rank add nothing.

        Raises:
            TypeError/ValueError, NotImplementedError, EPTimeoutError, EPRemoteError: as in dispatch.
        """
        return self._low_latency().combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                           return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> Tensor:
        """The bf16 ``[E/R, R*N, H]`` tensor to write expert outputs into for ``low_latency_combine(...,
        zero_copy=True)`` (DeepEP's): a view of this rank's low-latency area, overwritten by the next
        zero-copy combine's inputs only.

        Raises:
            TypeError/ValueError: not a low-latency handle of this Buffer.
        """
        ll = self._low_latency()
        h = ll.check_handle(handle)
        return ll.zero_copy_buffer(ll.layout(h[2], h[3], h[4]))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's buffer cleaning before low-latency calls. Nothing needs zeroing here (the area's words
        carry call numbers); it checks the sizes fit and, after an error, re-synchronises the group (a host
        rendezvous: call it on every rank).

        Raises:
            ValueError: sizes that do not fit ``num_rdma_bytes``.
        """
        self._low_latency().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank for this rank's low-latency calls (DeepEP's, with
        ``enable_shrink``): no rows are sent to it or awaited from it; its experts' entries combine to nothing.

        On a Buffer whose ranks span hosts, unmasking is a collective call: every rank of the group (the rank
        being unmasked too) calls it with the same rank, after every low-latency call it made has completed
        (pending hooks are dropped). The group meets as after an error (a bounded host exchange); each pair of
        ranks of which one had masked the other, ``rank_to_mask`` among them, renumbers its RDMA rings and
        unmasks the other (docs/low_latency.md). Masking stays local to this rank.

        Raises:
            ValueError: the Buffer was built without ``enable_shrink``, or a bad rank; across hosts, ranks that
                made different unmask calls (on every rank; nothing changed).
            EPTimeoutError: across hosts, a rank did not come within ``timeout_s`` (a dead rank cannot be
                unmasked; nothing changed, and that rank can join no later meeting of this Buffer), or the
                renumbering ran out of time (the Buffer is then unusable).
        """
        self._shrink().update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: Tensor) -> None:
        """Write into ``mask_status`` (int32 ``[R]``) 1 for each masked rank (masked by
        ``low_latency_update_mask_buffer``, or after it timed out with ``enable_shrink``), else 0.

        Raises:
            ValueError: no ``enable_shrink``, or ``mask_status`` not int32 ``[R]``.
        """
        self._shrink().query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (DeepEP's ``clean_mask_buffer``). Across hosts a collective call, as unmasking in
        ``low_latency_update_mask_buffer``: every rank calls it, and every pair of ranks that had masked one
        another renumbers its rings.

        Raises:
            ValueError: the Buffer was built without ``enable_shrink``; across hosts, ranks that made different
                unmask calls. EPTimeoutError: across hosts, as ``low_latency_update_mask_buffer``.
        """
        self._shrink().clean_mask()

    def _shrink(self):
        ll = self._low_latency()
        if not ll.shrink:
            raise ValueError("rank masking needs Buffer(..., enable_shrink=True)")
        return ll

    def get_rdma_stats(self) -> dict:
        """Traffic between hosts since construction (internode mode; triton-ep's own, not in DeepEP).

        Returns:
            a dict: ``transport`` (``None`` on one host, ``"verbs"`` or ``"emulated"``), ``num_hosts``, ``qps``
            (``"peer host/QP index"`` -> ``channel``, ``port``, ``bytes``, ``wrs`` (work requests), ``chunks``),
            ``ports`` (port -> bytes), ``channels`` (channel -> ``bytes``, ``chunks``), ``wrs`` (work requests
            posted), ``chunks`` (chunks posted), ``proxy_busy_s`` (seconds the RDMA proxy threads spent in
            sweeps that moved something, wall clock: its host cost), ``proxy_post_s`` (the part of it inside the
            transport's data posts: over the emulated fabric its payload copies), ``proxy_transport_s`` (the part
            inside any transport call: polls, posts, credits; the rest is the proxy's own Python),
            ``proxy_cpu_s`` (the proxy threads' CPU seconds in those sweeps: without their waits for the GIL),
            ``proxy_transport_cpu_s`` (the part of those inside transport calls; the rest is the proxy's own
            Python in CPU time),
            ``proxy_busy_sweeps`` (how many such sweeps), ``network_s`` (seconds this rank's calls spent in the
            network leg, waits included), ``exchanges`` (network legs: a call makes one or more) and
            ``host_exchanges`` (those that went through host memory: headers, statuses, counts; calls on the
            capture path make none).
            Bytes count payload written by this rank's proxy (not signals). On one host: zeros and empty dicts.
            With low-latency mode across hosts, ``low_latency``: the same counters of that mode's own network
            leg (to every other rank: its ``qps`` keys are ``"peer rank/QP index"``).

        Raises:
            EPError: the Buffer was destroyed.
        """
        self._rt.live()
        stats = self._internode.stats() if self._internode is not None else traffic_stats()
        if self._ll is not None and self._ll.net is not None:
            stats["low_latency"] = traffic_stats(self._rt.rdma_transport, self._rt.num_hosts, self._ll.net.sched.stats())
        return stats

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release this rank's shared buffers and peer mappings. Idempotent; later calls raise ``EPError``.
        Kernels still queued are waited for first (each wait they hold is bounded by ``timeout_s``). Across
        hosts, the RDMA proxy stops and its QPs, MRs, CQs and PD are released too."""
        try:
            internode_ll.close(self._ll)
        finally:
            try:
                if self._internode is not None:
                    self._internode.close()
            finally:
                self._rt.close()

    def check(self) -> None:
        """Raise what this Buffer's kernels have recorded since the last check: a wait that ran out of
        time (``EPTimeoutError`` naming the peer and the stage; the Buffer must then be destroyed and
        rebuilt), a peer that gave up or failed the call (``EPRemoteError``), or a peer that called
        another operation, handle or sizes (``ValueError``). Reads host memory only: no device
        synchronisation. Every call runs it first (and last); event waits run it too. Across hosts it also
        raises the RDMA proxy's and the ring kernels' errors and the capture path's statuses
        (docs/internode.md); the network leg's errors are permanent there, so every later check raises again.

        Raises:
            EPTimeoutError, EPRemoteError, EPCapacityError, ValueError: as above, each error once (across
            hosts, a network-leg error at every check).
            EPError: the Buffer was destroyed.
        """
        if self._internode is not None:
            self._internode.check()          # across hosts: also the RDMA proxy and the capture path's statuses
            if self._ll is not None:
                self._ll.check()             # low-latency mode's own signals and proxy
        else:
            self._rt.check()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.destroy()

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """The routing layout of this rank's tokens (local, no communication).

        Args:
            topk_idx: ``[T, K]`` int64 (or int32) expert ids, ``-1`` = none.
            num_experts: ``E``, a multiple of the group size.
            previous_event: an event to wait for first; async_finish: return an event on completion;
            allocate_on_comm_stream: accepted; outputs are allocated on the stream the kernels run on (the
                communication stream with ``async_finish``, else the caller's; see ``get_comm_stream``).

        Returns:
            ``num_tokens_per_rank`` int32 ``[R]``, ``num_tokens_per_rdma_rank`` int32 ``[num_hosts]`` (tokens
            that go to at least one rank of each host; ``None`` when every rank is on one host),
            ``num_tokens_per_expert`` int32 ``[E]``, ``is_token_in_rank`` bool ``[T, R]``, event.
            Ids outside ``[-1, E)`` are masked here and reported by ``dispatch``.

        Raises:
            TypeError/ValueError: bad dtype, shape, device, or ``E % R != 0``.
        """
        if self._internode is not None:
            return self._internode.get_dispatch_layout(self._intranode, topk_idx, num_experts, previous_event,
                                                       async_finish, allocate_on_comm_stream)
        if self._intranode.replay_layout is not None:
            out = intranode_replay.layout(self._intranode, topk_idx, num_experts, previous_event, async_finish)
            if out is not None:     # (a layout of the last layout's shapes again: its plan launched it)
                return out
        return self._intranode.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                   allocate_on_comm_stream)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: XLike, handle: Optional[tuple] = None, num_tokens_per_rank: Optional[Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[Tensor] = None, is_token_in_rank: Optional[Tensor] = None,
                 num_tokens_per_expert: Optional[Tensor] = None, topk_idx: Optional[Tensor] = None,
                 topk_weights: Optional[Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token row to every rank holding one of its experts (collective over the group).

        Args:
            x: ``[T, H]`` of any dtype whose row is a multiple of 16 bytes (bf16, fp16, fp32, fp64, int8,
                uint8, fp8...; the rows move as raw bytes, bit for bit, as in DeepEP's intranode dispatch; every
                rank must send the same dtype), or ``(x, scales)`` as DeepEP takes it: ``x`` ``[T, H]`` of
                1-byte elements (fp8 e4m3...) and ``scales`` fp32 or int32 (e.g. packed UE8M0) ``[T, S]``,
                any ``S`` and any strides; each row's ``S`` scales move with it, bit for bit (every rank must
                pass the same ``S`` and scale dtype). ``T`` may be 0 and differ across ranks.
            handle: a handle from an earlier dispatch of this Buffer: same routing, new data; then only
                ``x`` is sent and no counts are exchanged.
            num_tokens_per_rank: int32 ``[R]``; num_tokens_per_rdma_rank: int32 ``[num_hosts]`` across hosts
                (required there without a handle), ignored on one host;
            is_token_in_rank: bool ``[T, R]``; num_tokens_per_expert: int32 ``[E]`` (gives ``E``; required
                without a handle) -- as ``get_dispatch_layout`` returned them. With ``topk_idx``, the layout
                ``get_dispatch_layout`` computed for this very ``topk_idx`` is used when ``is_token_in_rank``
                is the tensor it returned (neither changed since, by their in-place version counters:
                writes torch does not count -- through ``.data``, a numpy view or a kernel of your own --
                are not seen, so after those pass the layout of the current ids); otherwise the routing is
                computed from ``topk_idx`` itself. Without ``topk_idx``, ``is_token_in_rank`` routes the
                rows.
            topk_idx: int64 (or int32) ``[T, K]``; topk_weights: fp32 ``[T, K]`` (optional).
            expert_alignment: per-expert counts are rounded up to a multiple of it.
            num_worst_tokens: if > 0, this rank's outputs have exactly this many rows (padding rows: ids -1,
                weights 0, x 0, ``recv_src_idx`` -1); more rows arriving at a rank than its value raise
                ``EPCapacityError`` (within one host on every rank, naming that rank; across hosts on the
                ranks that find it, docs/internode.md). Each rank may pass its own value, as in DeepEP (a
                host's ranks read each other's from the host's call cards, with a bounded wait on their host
                and no device synchronisation). Within one host the rounds follow from the largest value, so
                one rank's large value makes every rank take its rounds; across hosts each rank tells its
                peers in its streams' headers how many records it takes from each. Every rank passes a value
                > 0 or none does.
            config: accepted; results never depend on it. previous_event, async_finish,
            allocate_on_comm_stream: as DeepEP: the kernels run on the communication stream with
                ``async_finish`` (the returned event marks their end), else on the caller's stream.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:
            ``recv_x`` like ``x`` (same dtype) with ``N`` rows grouped by source rank (for a pair, a pair:
            the scales ``[N, S]`` row-major, of the scales' dtype),
            ``recv_topk_idx`` ``[N, K]`` of ``topk_idx``'s dtype: local expert ids (``-1`` where the expert
            lives elsewhere), ``recv_topk_weights`` fp32 ``[N, K]`` (0 where the id is ``-1``), and
            ``num_recv_tokens_per_expert_list``, a Python list of ``E/R`` ints -- an empty list when
            ``num_worst_tokens > 0``, as in DeepEP (the host never learns the counts then; they are the
            histogram of ``recv_topk_idx``). Without ``topk_idx``, ``recv_topk_idx`` and
            ``recv_topk_weights`` are ``None``. With a handle: ``(recv_x, None, None, None, None, event)``.
            ``event`` is always an :class:`EventOverlap` (holding no event unless ``async_finish``).

        Raises:
            TypeError/ValueError: bad arguments (before any kernel runs) or ids outside ``[-1, E)``;
            EPRemoteError: another rank failed the call; EPCapacityError: ``num_worst_tokens`` too small;
            EPTimeoutError: a peer did not answer within ``timeout_s``. Across hosts (docs/internode.md) also
            ``num_tokens_per_rdma_rank`` (int32 ``[num_hosts]``, from ``get_dispatch_layout``), required without a
            handle and checked; ProxyError: the RDMA proxy failed (a QP, a completion), naming peer and QP.
        """
        if self._internode is not None:
            return self._internode.dispatch(self._intranode, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                            expert_alignment, num_worst_tokens, config, previous_event)
        if (handle is not None and num_tokens_per_rank is None and is_token_in_rank is None
                and num_tokens_per_expert is None and topk_idx is None and topk_weights is None
                and expert_alignment.__class__ is int and expert_alignment == 1 and num_worst_tokens.__class__ is int
                and num_worst_tokens == 0 and num_tokens_per_rdma_rank is None and handle.__class__ is DispatchHandle):
            out = intranode_replay.cached_dispatch(self._rt, handle, x, config, previous_event, async_finish)
            if out is not None:     # (the call of the handle's last shapes again: its plan launched it)
                return out
        return self._rt.run(self._intranode.dispatch_steps(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
            allocate_on_comm_stream))

    # ------------------------------------------------------------------ combine
    def combine(self, x: Tensor, handle: tuple, topk_weights: Optional[Tensor] = None,
                bias: Union[None, Tensor, Tuple[Tensor, ...]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Return rows along the routes of ``handle`` and sum them per source token (collective).

        Args:
            x: bf16 ``[N, H]``, one row per row the dispatch delivered here (``N`` includes any
                ``num_worst_tokens`` padding, which is ignored). Only bf16 is reduced, as in DeepEP: other
                dtypes raise ``TypeError``.
            handle: the handle of the matching dispatch of this Buffer.
            topk_weights: fp32 ``[N, K]`` or ``None``: summed back the same way.
            bias: ``None``, a bf16 ``[T, H]`` tensor or a tuple of up to two, added after the sum.
            config, previous_event, async_finish, allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            ``(combined_x bf16 [T, H], combined_topk_weights fp32 [T, K] or None, event)``: the fp32 sum
            over destination ranks in ascending rank order (no weights applied), plus the biases, rounded
            once to bf16. Deterministic and independent of buffer size and config.

        Raises:
            TypeError/ValueError: bad arguments or a handle of another Buffer or shape; EPRemoteError,
            EPTimeoutError, NotImplementedError: as in ``dispatch``.
        """
        if self._internode is not None:
            return self._internode.combine(x, handle, topk_weights, bias, config, previous_event)
        if bias is None and handle.__class__ is DispatchHandle:
            out = intranode_replay.combine(self._rt, handle, x, topk_weights, config, previous_event, async_finish)
            if out is not None:     # (the call of the handle's last shapes again: its plan launched it)
                return out
        return self._rt.run(self._intranode.combine_steps(x, handle, topk_weights, bias, config, previous_event,
                                                          async_finish, allocate_on_comm_stream))
