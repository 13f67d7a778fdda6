"""``Buffer``: DeepEP V1's normal-mode API over Triton kernels and same-host shared buffers.

Each public call checks its arguments, launches the kernels of :mod:`triton_ep.kernels` and moves data
through :mod:`triton_ep.transport.ipc`. The body of every collective call is a generator that yields at
each phase boundary; :meth:`Buffer._run` drives it, meeting the other ranks on the host only at
:class:`_Meet` steps (a re-synchronisation after an error), while the kernels wait for each other on the
device (:mod:`triton_ep.kernels.flags`); a plain dispatch's host waits once, polling the counts its notify
kernel writes to host-visible memory. :mod:`triton_ep.testing` drives the same generators for ranks
simulated in one process.

Errors (docs/design.md section 4): bad shapes, dtypes and devices are found before any kernel runs. So that
no rank is left waiting, the rank that found them posts a failure word its peers' kernels see, then raises
``ValueError``/``TypeError``; the other ranks raise :class:`~triton_ep.errors.EPRemoteError` naming it.
Bad ids are masked by the kernels and reported the same way. Errors the kernels record are raised by
:meth:`Buffer.check`. A peer that never arrives gives :class:`~triton_ep.errors.EPTimeoutError`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import uuid
import weakref
import zlib
import warnings
from typing import Generator, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from . import kernels
from .config import Config, EventOverlap
from .errors import EPError, EPRemoteError, EPTimeoutError
from .kernels.combine import record_bytes as combine_record_bytes
from .kernels import flags as F
from .kernels import notify as NT
from .kernels.dispatch import record_words as dispatch_record_words
from .protocol import call_card as card
from .transport import ipc, signals
from .transport.bootstrap import Exchange

Tensor = torch.Tensor
XLike = Union[Tensor, Tuple[Tensor, Tensor]]

_DEFAULT_TIMEOUT_S = 100.0
_NO_CTX = contextlib.nullcontext()        # reusable: entering it does nothing
# Exchange-slot header words (int64).
_ST, _SIG0 = 0, 2                      # status, signature words [2, 10) (word 1 unused)
_BASE, _HASERR, _SEQ, _XN = 12, 13, 14, 15   # rounds completed, holds an error, dispatches, exchange number
_OP_DISPATCH, _OP_CACHED_DISPATCH, _OP_COMBINE, _OP_RESYNC = 1, 2, 3, 4


class _Meet(str):
    """A step where the ranks meet on the host (a bounded barrier in the control block): the
    re-synchronisation after an error. Every other step a
    call yields is only a phase boundary: ranks simulated in one process run their launches phase by
    phase, and real ranks wait for each other on the device."""
_STATUS_TEXT = {1: "invalid arguments", 2: "topk_idx ids outside [-1, num_experts)"}


def _steps(fn):
    """Decorate a collective's step generator: whatever it raises, this rank first tells its peers
    (a failure word in their signal headers), so kernels of theirs that wait for this rank's part of the
    call stop at once and raise ``EPRemoteError``; the next call re-synchronises the group."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        try:
            return (yield from fn(self, *args, **kwargs))
        except GeneratorExit:
            raise
        except BaseException as e:
            if getattr(self, "_comm", None) is not None and not getattr(e, "_ep_recorded", False):
                # the failure word names the round after this rank's completed ones: its earlier calls'
                # kernels must have finished (so a peer still in one of those is not told it failed)
                self._wait_comm_stream()
                self._sig.post_local_failure()
            raise
    return run


@dataclasses.dataclass
class DispatchArgs:
    """One dispatch call's checked arguments (what the steps of the call read).

    ``x`` ``[T, H]`` (contiguous) and its ``scales`` ``[T, S]`` (contiguous, fp32 or int32, any ``S >= 0``;
    given with a 1-byte ``x``, as DeepEP) or ``None``; ``row_words`` and ``scale_words`` (``S``): a row and
    its scales in 32-bit words; ``dtype_code``: the dtype as the cross-rank signature carries it;
    ``topk_idx``/``topk_weights`` ``[T, K]`` or ``None``; ``is_token_in_rank`` ``[T, R]`` and
    ``num_tokens_per_expert`` ``[E]`` (int32, used only without ``topk_idx``); ``handle`` for a cached
    dispatch; ``flags``: bit 0 scales, bit 1 cached, bit 2 weights, bit 3 int32 scales (signature).
    """
    x: Tensor
    scales: Optional[Tensor]
    num_tokens: int
    row_words: int
    scale_words: int
    dtype_code: int
    expert_alignment: int
    topk_idx: Optional[Tensor] = None
    topk_weights: Optional[Tensor] = None
    num_topk: int = 0
    num_experts: int = 0
    is_token_in_rank: Optional[Tensor] = None
    num_tokens_per_expert: Optional[Tensor] = None
    handle: Optional["DispatchHandle"] = None
    flags: int = 0


class DispatchHandle(tuple):
    """The communication handle ``dispatch`` returns, shaped as DeepEP's intranode handle::

        (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
         is_token_in_rank, send_head)

    Every entry has DeepEP's dtype; the two channel matrices are DeepEP's with one channel (``C = 1``;
    DeepEP has ``C = num_sms / 2``), see docs/design.md, *Handle*:

    - ``rank_prefix_matrix`` int32 ``[R, R]``: ``[i][j]`` = rows rank ``j`` receives from ranks ``0..i``.
    - ``channel_prefix_matrix`` int32 ``[R, 1]``: ``[j][0]`` = rows this rank sends to rank ``j``.
    - ``recv_channel_prefix_matrix`` int32 ``[R, 1]``: ``[s][0]`` = where the channel starts within source
      ``s``'s rows here: 0.
    - ``recv_src_idx`` int32 ``[N]``: source token index of each received row (``-1`` on padding rows).
    - ``is_token_in_rank`` bool ``[T, R]``; ``send_head`` int32 ``[T, R]``: index of token ``t`` among the
      rows sent to rank ``r``, ``-1`` where it is not sent.

    It also remembers, on the host, what cached calls need without a device synchronisation.
    """

    def __new__(cls, items: tuple, buffer_uid: str, num_tokens: int, num_recv_tokens: Optional[int],
                recv_rows_max: int, area_rows_max: int, seq: int, row_base: Tensor, combine_tables: Tensor,
                n_recv_dev: Optional[Tensor] = None):
        self = super().__new__(cls, items)
        self.seq = seq
        self.buffer_uid = buffer_uid
        self.num_tokens = num_tokens
        self.num_recv_tokens = num_recv_tokens
        self.num_out_rows = int(items[3].shape[0])
        #: the most rows any rank of the group receives, and the largest combine area (rows returned to
        #: one source): they size the rounds of cached dispatches and combines, the same on every rank
        #: (with ``num_worst_tokens``, bounds from it: the host never learnt the counts)
        self.recv_rows_max, self.area_rows_max = recv_rows_max, area_rows_max
        #: int64 [R] on the device: where this rank's rows start among each receiver's rows
        self.row_base = row_base
        #: int64 [3R] on the device: combine's comb_base, send_base and prefix (no upload per combine)
        self.combine_tables = combine_tables
        R = int(items[0].shape[0])
        #: the same three as views, made once
        self.combine_views = (combine_tables[:R], combine_tables[R:2 * R], combine_tables[2 * R:])
        #: per call shape (operation, widths): record size, rows per round, rounds and call signature,
        #: worked out by the first call of that shape
        self.plans: dict = {}
        #: int64 [1] on the device: rows received, for a handle whose host never learnt the counts
        #: (``num_worst_tokens``; then ``num_recv_tokens`` is ``None``)
        self.n_recv_dev = n_recv_dev
        return self

    @property
    def rank_prefix_matrix(self) -> Tensor:
        """int32 ``[R, R]``: ``[i][j]`` = rows rank ``j`` receives from ranks ``0..i``."""
        return self[0]

    @property
    def recv_src_idx(self) -> Tensor:
        """int32 ``[N]``: the source token of each received row (``-1`` on padding rows)."""
        return self[3]

    @property
    def is_token_in_rank(self) -> Tensor:
        """bool ``[T, R]``: whether token ``t`` went to rank ``r``."""
        return self[4]

    @property
    def send_head(self) -> Tensor:
        """int32 ``[T, R]``: index of token ``t`` among the rows sent to rank ``r`` (``-1``: not sent)."""
        return self[5]


_dtype_code = card.dtype_code
_DTYPE_NAMES = card._DTYPE_NAMES


def _sig_text(words) -> str:
    """Signature words for an error message, a dtype code shown as its name."""
    return "[" + ", ".join(_DTYPE_NAMES.get(int(w), str(int(w))) if i == 7 else str(int(w))
                           for i, w in enumerate(words)) + "]"


def _collective(e: BaseException) -> BaseException:
    """Mark ``e`` as raised on every rank at the same step (the group stays in step)."""
    e._ep_collective = True
    return e


_MAX_INT32 = 2 ** 31 - 1
_MAX_ROWS = 1 << 62          # "no capacity limit" for the notify of a plain dispatch


def _to_dev(a, dtype: torch.dtype, device: torch.device, shape=None) -> Tensor:
    """A fresh contiguous device tensor from host values (numpy views may be strided).

    On CUDA the values go through pinned memory and an asynchronous copy: a copy from pageable memory
    would first wait for everything queued on the stream (a hidden device synchronisation). Torch's
    pinned-memory cache keeps the staging block until the copy has run."""
    t = torch.tensor(np.ascontiguousarray(a), dtype=dtype, device="cpu")
    t = t.reshape(shape) if shape is not None else t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _version_of(t: Tensor) -> Optional[int]:
    """A tensor's in-place version counter; ``None`` for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _timeout_arg(timeout_s) -> float:
    """``timeout_s`` checked, or ``TRITON_EP_TIMEOUT_S``, or the default (seconds)."""
    if timeout_s is None:
        env = os.environ.get("TRITON_EP_TIMEOUT_S", str(_DEFAULT_TIMEOUT_S))
        try:
            timeout_s = float(env)
        except ValueError:
            raise ValueError(f"TRITON_EP_TIMEOUT_S must be a number of seconds, got {env!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a finite positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def _device_arg(device) -> torch.device:
    """The Buffer's device: the given one (a CUDA device without index means the current one), else the
    current CUDA device, else CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_event(ev) -> None:
    if ev is not None and not isinstance(ev, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap (e.g. from Buffer.capture()), got {type(ev).__name__}")


def _check_config(config) -> None:
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a triton_ep.Config or None, got {type(config).__name__}")


def _isint(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class Buffer:
    """Expert-parallel communication buffer, a drop-in for DeepEP V1's ``deep_ep.Buffer`` in normal mode
    within one host.

    Args:
        group: the EP process group (any backend: gloo or NCCL; used only to exchange buffer handles).
            ``None`` means the default group.
        num_nvl_bytes: bytes of this rank's intranode buffer, e.g. ``Config.get_nvl_buffer_size_hint``.
            Transfers larger than it go through it in rounds.
        num_rdma_bytes: with ``low_latency_mode``, bytes of the low-latency area
            (``get_low_latency_rdma_size_hint``), mapped by every rank of the host; else unused.
        low_latency_mode: enable the ``low_latency_*`` calls (docs/low_latency.md).
        enable_shrink: allow rank masking in low-latency mode (a peer that times out is masked).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy,
        comm: DeepEP's keyword arguments, accepted; those that do not apply within one host are ignored.
        timeout_s: bound in seconds on every wait for a peer (default 100, or ``TRITON_EP_TIMEOUT_S``).
        device: where buffers and inputs live; default the current CUDA device, else CPU.

    Raises:
        ValueError: ranks on different hosts, or a bad argument value.
        EPTimeoutError: a rank did not join within ``timeout_s``.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, timeout_s: Optional[float] = None,
                 device: Optional[Union[str, torch.device]] = None, **unused) -> None:
        if unused:
            warnings.warn(f"triton_ep.Buffer ignores unknown arguments {sorted(unused)}", stacklevel=2)
        self._comm = None
        exchange = None
        if not isinstance(group, ipc.Comm):
            if group is None and not dist.is_initialized():
                raise ValueError("Buffer(group=None) needs torch.distributed initialised (init_process_group) "
                                 "or an explicit group")
            group = group if group is not None else dist.group.WORLD
            # made before the checks below: a rank that rejects its arguments tells its peers at once
            exchange = Exchange(group, _DEFAULT_TIMEOUT_S, "bootstrap: exchange buffer handles")
        try:
            self.timeout_s = _timeout_arg(timeout_s)
            if not _isint(num_nvl_bytes) or num_nvl_bytes < 0:
                raise ValueError(f"num_nvl_bytes must be a non-negative int, got {num_nvl_bytes!r}")
            if not _isint(num_rdma_bytes) or num_rdma_bytes < 0:
                raise ValueError(f"num_rdma_bytes must be a non-negative int, got {num_rdma_bytes!r}")
            device = _device_arg(device) if exchange is not None else device
        except Exception as e:
            if exchange is not None:
                exchange.fail(f"rejected its Buffer arguments ({type(e).__name__}: {e})")
            raise
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self._uid = uuid.uuid4().hex
        self._op = 0
        self._dispatch_seq = 0
        nvl_part = ll_bytes = 0
        if exchange is None:                     # ranks simulated in one process (triton_ep.testing)
            self._comm = group
            self.group = None
        else:
            self.group = group
            exchange.timeout_s = self.timeout_s
            # Low-latency mode: the area sized by num_rdma_bytes follows the normal-mode part of the same
            # shared buffer (every rank maps it), which normal-mode rounds never touch.
            nvl_part = max(4096, (self.num_nvl_bytes + 4095) // 4096 * 4096)
            ll_bytes = (self.num_rdma_bytes + 4095) // 4096 * 4096 if self.low_latency_mode else 0
            self._comm = ipc.open_group(self.group, nvl_part + ll_bytes, device,
                                        self.timeout_s, self._slot_words(self.group.size()), exchange)
            self._comm.timeout_s = self.timeout_s
            self._comm.min_bytes -= ll_bytes
        self.rank, self.group_size = self._comm.rank, self._comm.size
        self.device = self._comm.device
        with torch.inference_mode(False):
            self._delta_words = self._comm.delta_bytes // 4
        c = self._comm
        self._sig = signals.Signals(c.rank, c.size, c.header, c.peer_headers, c.delta_bytes, c.device,
                                    self.timeout_s, interpreted=kernels.interpreted())
        self._sig_args = self._sig.kernel_args(c.max_programs)
        #: this rank's call card and its count of collective calls (named disagreements)
        self._card, self._calls = c.card(c.rank), 0
        self._sig.explain_mismatch = self._explain_mismatch
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        #: the running call's kernels go to the communication stream (async_finish), else the caller's
        self._on_comm = False
        #: work of an earlier call may still run on the communication / the caller's stream
        self._comm_dirty = self._caller_dirty = False
        #: host-visible block of a plain dispatch's notify results, and the last dispatch number sent there
        self._notify_res: Optional[Tensor] = None
        self._notify_np: Optional[np.ndarray] = None
        self._notify_seq = 0
        #: the last get_dispatch_layout: (weak ref to its topk_idx, its version, E, is_token_in_rank's
        #: version, the layout), for the dispatch that passes it back
        self._layout_memo = None
        self._ll = None
        if self.low_latency_mode and self.group is not None and ll_bytes:
            from .low_latency import LowLatency
            self._ll = LowLatency(self, nvl_part, ll_bytes, enable_shrink)
            with torch.inference_mode():
                self._ll.ctl.zero_()              # peers write here only after the barrier
        if self.group is not None:
            try:
                self._agree_on_layout(nvl_part, ll_bytes)
            except BaseException:
                self._comm.close()
                self._comm = None
                raise

    def _agree_on_layout(self, nvl_part: int, ll_bytes: int) -> None:
        """Every rank publishes where its low-latency area lies (``num_nvl_bytes`` rounded, the area's
        bytes: 0 without ``low_latency_mode``) and meets the others: the kernels address a peer's area at
        this rank's own offset, so ranks must agree.

        Raises:
            ValueError: on every rank, when ranks disagree (naming the first rank that differs).
            EPTimeoutError: a rank did not arrive within ``timeout_s``.
        """
        c = self._comm
        mine = (0x4C4C, ll_bytes, nvl_part if ll_bytes else 0)
        c.slot(1, self.rank)[:3] = mine       # parity-1 slots: the first exchange of a call uses parity 0
        c.barrier("bootstrap/low-latency area")
        for r in range(self.group_size):
            theirs = tuple(int(v) for v in c.slot(1, r)[:3])
            if theirs != mine:
                raise ValueError(
                    f"rank {self.rank}: rank {r} built its Buffer with low_latency_mode="
                    f"{bool(theirs[1])}, a low-latency area of {theirs[1]} bytes after {theirs[2]} normal-mode "
                    f"bytes; this rank with low_latency_mode={bool(ll_bytes)}, {ll_bytes} bytes after "
                    f"{mine[2]}; every rank must pass the same low_latency_mode, num_rdma_bytes and (in "
                    f"low-latency mode) num_nvl_bytes")

    # ------------------------------------------------------------------ static, DeepEP-compatible helpers
    @staticmethod
    def _slot_words(num_ranks: int) -> int:
        return ipc.SLOT_HEADER + num_ranks + ipc.MAX_EXPERTS

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count DeepEP's configs carry (even, positive). Results never depend on it.

        Raises:
            ValueError: ``new_num_sms`` is not a positive even int.
        """
        if not _isint(new_num_sms) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"the SM count must be a positive even int, got {new_num_sms!r}")
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
        if not _isint(num_ranks) or num_ranks < 1:
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
            ValueError: a size is not a positive int, or ``num_experts % num_ranks != 0``.
        """
        from .low_latency import size_hint
        vals = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        if not all(_isint(v) and v > 0 for v in vals) or num_experts % num_ranks:
            raise ValueError(f"get_low_latency_rdma_size_hint takes positive ints with num_experts % num_ranks == 0, "
                             f"got {vals}")
        return size_hint(*vals)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """A view of this rank's raw intranode buffer as ``dtype`` (from element ``offset``, optionally
        reshaped to ``size``). Its contents change with every call.

        Raises:
            ValueError: ``use_rdma_buffer`` (no RDMA buffer within one host) or ``size`` too large.
        """
        if use_rdma_buffer:
            raise ValueError("triton_ep has no RDMA buffer within one host")
        t = self._comm.data.view(dtype)[offset:]
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
        return self._comm_stream

    def _unavailable(self, *args, **kwargs):
        """DeepEP entry points this release does not implement: the internode ones (``internode_dispatch``,
        ``internode_combine``).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("triton_ep implements DeepEP's normal and low-latency modes within one host "
                                  "only; internode kernels are not available yet")

    internode_dispatch = internode_combine = _unavailable

    # ------------------------------------------------------------------ low-latency mode (docs/low_latency.md)
    def _low_latency(self):
        self._live()
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
            x: bf16 ``[T, H]``, ``T <= num_max_dispatch_tokens_per_rank`` (``N``), ``H % 128 == 0``.
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
            TypeError/ValueError: bad arguments (before any launch; the peers raise ``EPRemoteError``).
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
            use_logfmt: not implemented (``NotImplementedError``).
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

        Raises:
            ValueError: the Buffer was built without ``enable_shrink``, or a bad rank.
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
        """Unmask every rank (DeepEP's ``clean_mask_buffer``).

        Raises:
            ValueError: the Buffer was built without ``enable_shrink``.
        """
        self._shrink().clean_mask()

    def _shrink(self):
        ll = self._low_latency()
        if not ll.shrink:
            raise ValueError("rank masking needs Buffer(..., enable_shrink=True)")
        return ll

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release this rank's shared buffers and peer mappings. Idempotent; later calls raise ``EPError``.
        Kernels still queued are waited for first (each wait they hold is bounded by ``timeout_s``)."""
        if getattr(self, "_comm", None) is not None:
            try:
                if self._comm_stream is not None:
                    self._comm_stream.synchronize()
                self._comm.sync_device()
            finally:
                self._comm.close()
                self._comm = None

    # ------------------------------------------------------------------ errors recorded by kernels
    def check(self) -> None:
        """Raise what this Buffer's kernels have recorded since the last check: a wait that ran out of
        time (``EPTimeoutError`` naming the peer and the stage; the Buffer must then be destroyed and
        rebuilt), a peer that gave up or failed the call (``EPRemoteError``), or a peer that called
        another operation, handle or sizes (``ValueError``). Reads host memory only: no device
        synchronisation. Every call runs it first (and last); event waits run it too.

        Raises:
            EPTimeoutError, EPRemoteError, ValueError: as above, each error once.
            EPError: the Buffer was destroyed.
        """
        comm = self._live()
        err = self._sig.error()
        if err is None:
            if comm.broken:                 # reported once already: the Buffer stays unusable
                raise EPError(f"rank {self.rank}: this Buffer is unusable after an earlier failure ({comm.broken}); "
                              f"destroy() it and build a new one")
            return
        if self._sig.permanent() and comm.broken is None:
            comm.broken = str(err)
        err._ep_recorded = True             # the kernel that recorded it told the peers already
        raise _collective(err)

    def _publish(self, code: int, values: Sequence[int]) -> None:
        """Write this call's card (:mod:`triton_ep.protocol.call_card`) where the peers can read it: a
        mismatch the kernels find is then raised naming the field and each rank's value."""
        self._calls += 1
        card.write(self._card, self._calls, code, values)

    def _explain_mismatch(self, peer: int) -> Optional[str]:
        """What differs between this rank's latest call and ``peer``'s, from their cards (``None``: unknown)."""
        c = self._comm
        if c is None or c.ctrl is None:
            return None
        return card.describe(c.card(self.rank), c.card(peer), self.rank, peer)

    def _fail_call(self, err: BaseException) -> BaseException:
        """This rank rejects a call its peers run without a host wait: they learn it from the failure
        word :func:`_steps` posts and raise ``EPRemoteError``; this Buffer stays usable."""
        err._ep_collective = True
        return err

    def _resync_steps(self) -> Generator:
        """After an error: meet every rank on the host and start the round counters afresh."""
        yield from self._exchange("resync after an error", None, 1, [_OP_RESYNC], "operation")

    # ------------------------------------------------------------------ streams
    def _comm_ctx(self):
        """Run what follows on the stream of the running call: the communication stream for a call with
        ``async_finish``, else the caller's (a no-op on CPU)."""
        return torch.cuda.stream(self._comm_stream) if self._on_comm else _NO_CTX

    def _begin(self, previous_event: Optional[EventOverlap], async_finish: bool) -> None:
        """Order the call's kernels after the caller's work.

        With ``async_finish`` (DeepEP's overlap) they run on the communication stream, which first waits
        for ``previous_event`` or, without one, for the caller's current stream. Without it the caller's
        stream would wait for the communication stream right after the call, so the kernels run on the
        caller's stream itself (after ``previous_event``, if given): the same order, without two
        cross-stream waits per call. Calls of one Buffer stay in issue order across the two streams: a
        call on one stream first waits for work the other still holds from an earlier call."""
        self._on_comm = False
        if self._comm_stream is None:
            return
        ev = previous_event.event if previous_event is not None else None
        if not async_finish:
            current = None
            if self._comm_dirty:          # an earlier call's kernels still run on the communication stream
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(self._comm_stream)
                self._comm_dirty = False
            if ev is not None:
                (current or torch.cuda.current_stream(self.device)).wait_event(ev)
            self._caller_dirty = True
            return
        self._on_comm = True
        if ev is not None:
            self._comm_stream.wait_event(ev)
        if ev is None or self._caller_dirty:   # earlier calls' kernels ran on the caller's stream
            self._comm_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._caller_dirty = False

    def _wait_comm_stream(self) -> None:
        """Wait for work the communication stream may still hold (an ``async_finish`` call's, or the running
        one's): an error path or a host rendezvous needs this rank's device work finished."""
        if self._comm_stream is not None and (self._comm_dirty or self._on_comm):
            self._comm_stream.synchronize()

    def _end(self, async_finish: bool, tensors: Sequence[Optional[Tensor]]) -> EventOverlap:
        """Hand the call's results to the caller: with ``async_finish`` an event on the communication
        stream (the tensors are marked as used there, so the caching allocator keeps them until then);
        else the work is on the caller's stream already."""
        if not self._on_comm:
            return EventOverlap(None, check=self.check)
        self._on_comm = False
        self._comm_dirty = True
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(self._comm_stream)
        ev = torch.cuda.Event()
        ev.record(self._comm_stream)
        return EventOverlap(ev, check=self.check)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.destroy()

    def _live(self) -> ipc.Comm:
        if self._comm is None:
            raise EPError(f"rank {self.rank}: this Buffer was destroyed")
        return self._comm

    # ------------------------------------------------------------------ argument checks
    def _check_tensor(self, name: str, t, dtypes: Sequence[torch.dtype], shape: Sequence[Optional[int]],
                      why: str = "") -> Tensor:
        """``t`` checked (type, dtype, shape with ``None`` for any size, device) and made contiguous.
        ``why`` says where the expected sizes come from (e.g. ``"T = 5 rows of x"``), so the error names
        which of two disagreeing arguments to look at."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}{f' ({why})' if why else ''}, got {list(t.shape)}")
        if t.device.type != self.device.type or (self.device.index is not None and t.device.index != self.device.index):
            raise ValueError(f"{name} is on {t.device}, but this Buffer works on {self.device}")
        if t.numel() == 0:      # an empty view may keep odd strides (and a null data pointer)
            return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        return t.contiguous()

    def _check_x(self, x: XLike) -> Tuple[Tensor, Optional[Tensor]]:
        if isinstance(x, tuple) and len(x) == 2 and x[1] is None:
            x = x[0]            # DeepEP unpacks (x, None) as x without scales (and returns recv_x alone)
        if isinstance(x, tuple):
            # DeepEP's intranode dispatch (csrc/deep_ep.cpp, "FP8 scales checks"): x of 1-byte elements, scales
            # fp32 or int32 (e.g. packed UE8M0) [T, S] with any S and any strides; S floats move per row
            if len(x) != 2:
                raise ValueError(f"x as a tuple must be (x [T, H] of 1-byte elements, scales [T, S] fp32 or int32), "
                                 f"got a tuple of {len(x)}")
            if isinstance(x[0], torch.Tensor) and (x[0].element_size() != 1 or x[0].is_quantized):
                raise TypeError(f"x[0] must have plain 1-byte elements (e.g. torch.float8_e4m3fn) when scales are "
                                f"given, got {x[0].dtype}")
            xv = self._check_tensor("x[0]", x[0], (x[0].dtype,) if isinstance(x[0], torch.Tensor) else (), (None, None))
            T, H = xv.shape
            if H % 16 or H == 0:
                raise ValueError(f"x[0] rows must be a non-zero multiple of 16 bytes, got hidden {H} ({H} bytes)")
            sc = self._check_tensor("x[1] (scales)", x[1], (torch.float32, torch.int32), (T, None))
            return xv, sc
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor or an (fp8 tensor, scales) pair, got {type(x).__name__}")
        if x.is_quantized:
            raise TypeError(f"x must be a plain tensor (its rows are moved as raw bytes), got quantized {x.dtype}")
        xv = self._check_tensor("x", x, (x.dtype,), (None, None))
        if (xv.shape[1] * xv.element_size()) % 16 or xv.shape[1] == 0:
            raise ValueError(f"x rows must be a non-zero multiple of 16 bytes, got hidden {xv.shape[1]} "
                             f"({xv.shape[1] * xv.element_size()} bytes)")
        return xv, None

    def _check_handle(self, handle) -> DispatchHandle:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the handle a dispatch of triton_ep returned, got {type(handle).__name__}")
        if handle.buffer_uid != self._uid:
            raise ValueError("handle was made by another Buffer; pass the handle this Buffer's dispatch returned")
        return handle

    # ------------------------------------------------------------------ collective plumbing
    def _run(self, gen: Generator):
        """Drive a collective's steps: meet the other ranks at its host steps (:class:`_Meet`); every other
        step is a phase boundary the kernels synchronise on the device. A rank that fails in the middle of
        a call (with an error its peers do not share: out of memory, an interrupt) can no longer keep step
        with them: it tells them (they raise at once instead of waiting) and its Comm is marked broken, so
        it never meets them at a wrong step."""
        comm = self._live()
        started = False
        try:
            stage = next(gen)
            while True:
                started = True
                if isinstance(stage, _Meet):
                    # this rank's device work must have finished (the rendezvous compares round counters)
                    self._wait_comm_stream()
                    try:
                        comm.barrier(stage, gone=self._sig.gone_peers)
                    except EPTimeoutError:
                        self._sig.leave(int(F.STAGE_HOST))     # the peers must not wait for this rank
                        raise
                stage = next(gen)
        except StopIteration as stop:
            return stop.value
        except BaseException as e:
            if started and not getattr(e, "_ep_collective", False) and comm.broken is None:
                comm.broken = f"rank {self.rank} failed in the middle of a call ({type(e).__name__}: {e})"
                self._sig.leave(int(F.STAGE_FAILED))             # its peers stop waiting for it at once
            raise
        finally:
            gen.close()

    def _exchange(self, stage: str, err: Optional[BaseException], status: int, sig: Sequence[int],
                  sig_names: str, fill=None) -> Generator:
        """Publish this rank's status, signature (and, through ``fill``, its counts), meet the others,
        then raise on every rank if any rank failed (every exception raised here is raised on all ranks at
        the same step). Returns the list of all ranks' slots."""
        comm = self._live()
        parity = self._op & 1
        self._op += 1
        slot = comm.slot(parity, self.rank)
        slot[:ipc.SLOT_HEADER] = 0
        slot[_ST] = 0 if err is None else status
        slot[_SIG0:_SIG0 + len(sig)] = sig
        with self._comm_ctx():
            slot[_BASE], slot[_HASERR] = self._sig.local_state()
        slot[_SEQ] = self._dispatch_seq
        slot[_XN] = self._op          # this rank's exchange count: equal on ranks in step
        if fill is not None and err is None:
            fill(slot)
        yield _Meet(stage)
        slots = [comm.slot(parity, r).copy() for r in range(self.group_size)]
        behind = [r for r, sl in enumerate(slots) if sl[_XN] != slot[_XN]]
        if behind:
            # a rank made another number of host exchanges (ranks called different operations, e.g. a
            # dispatch against a combine): the host meeting points no longer pair up
            comm.broken = (f"ranks out of step: rank {behind[0]} has met the others on the host a different number "
                           f"of times (the ranks called different operations)")
            raise _collective(EPError(f"rank {self.rank}: {comm.broken}; destroy() and rebuild the Buffer"))
        # Every rank's device work has finished (each synchronised before it arrived): after an error,
        # or if round counters differ, every rank starts afresh above the highest round any rank used.
        bases = [int(s[_BASE]) for s in slots]
        # dispatch numbers name handles in call signatures: after a call that only some ranks made, they
        # agree again from here on
        self._dispatch_seq = max(int(s[_SEQ]) for s in slots)
        if any(s[_HASERR] for s in slots) or len(set(bases)) > 1:
            with self._comm_ctx():
                self._sig.resync(max(bases) + 1)
        if err is not None:
            raise _collective(err)
        bad = [r for r in range(self.group_size) if slots[r][_ST]]
        if bad:
            r = bad[0]
            raise _collective(EPRemoteError(
                f"rank {self.rank}: rank {r} failed '{stage}' ({_STATUS_TEXT.get(int(slots[r][_ST]), 'error')}; "
                f"rank {r} raised the details); no data was moved"))
        for r in range(self.group_size):
            if not np.array_equal(slots[r][_SIG0:_SIG0 + len(sig)], slots[0][_SIG0:_SIG0 + len(sig)]):
                raise _collective(ValueError(
                    f"'{stage}': rank {r} called with ({sig_names}) = {_sig_text(slots[r][_SIG0:_SIG0 + len(sig)])} "
                    f"but rank 0 with {_sig_text(slots[0][_SIG0:_SIG0 + len(sig)])}; all ranks must call the same "
                    f"operation with the same handle, sizes and dtype (all ranks must agree)"))
        return slots

    def _capacity(self, row_bytes: int, stage: str) -> int:
        cap = self._live().min_bytes // row_bytes
        if cap < 1:      # the same on every rank: computed from shared values
            raise _collective(ValueError(
                f"'{stage}': a row needs {row_bytes} bytes but the smallest rank buffer holds "
                f"{self._comm.min_bytes} (num_nvl_bytes, rounded up to 4 KiB); raise num_nvl_bytes "
                f"(see Config.get_nvl_buffer_size_hint)"))
        return cap


    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """The routing layout of this rank's tokens (local, no communication).

        Args:
            topk_idx: ``[T, K]`` int64 (or int32) expert ids, ``-1`` = none.
            num_experts: ``E``, a multiple of the group size.
            previous_event: an event to wait for first; async_finish: return an event on completion;
            allocate_on_comm_stream: accepted (one stream is used).

        Returns:
            ``num_tokens_per_rank`` int32 ``[R]``, ``None`` (no RDMA ranks within one host),
            ``num_tokens_per_expert`` int32 ``[E]``, ``is_token_in_rank`` bool ``[T, R]``, event.
            Ids outside ``[-1, E)`` are masked here and reported by ``dispatch``.

        Raises:
            TypeError/ValueError: bad dtype, shape, device, or ``E % R != 0``.
        """
        self._live()
        idx = self._check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (None, None))
        self._check_num_experts(num_experts)
        _check_event(previous_event)
        self.check()
        self._begin(previous_event, async_finish)
        with self._comm_ctx():
            lay = kernels.routing_layout(idx, num_experts, self.group_size)
        per_rank, per_expert, in_rank = lay[:3]
        # kept for the dispatch that takes this layout (the same topk_idx and is_token_in_rank, unchanged):
        # it then uses these send positions and counts instead of computing the layout again
        vi, vr = _version_of(idx), _version_of(in_rank)
        self._layout_memo = (weakref.ref(idx), vi, int(num_experts), vr, lay) if None not in (vi, vr) else None
        return per_rank, None, per_expert, in_rank, self._end(async_finish, (idx, per_rank, per_expert, in_rank))

    def _check_num_experts(self, num_experts) -> None:
        if not _isint(num_experts) or num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(f"num_experts must be a positive multiple of the group size {self.group_size}, "
                             f"got {num_experts!r}")
        if num_experts > ipc.MAX_EXPERTS:
            raise ValueError(f"num_experts {num_experts} exceeds the supported maximum {ipc.MAX_EXPERTS}")

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
            num_tokens_per_rank: int32 ``[R]``; num_tokens_per_rdma_rank: ignored (one host);
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
            num_worst_tokens: if > 0, outputs have exactly this many rows (padding rows: ids -1, weights 0,
                x 0, ``recv_src_idx`` -1); more arriving rows raise ``EPCapacityError`` on every rank.
            config: accepted; results never depend on it. previous_event, async_finish,
            allocate_on_comm_stream: as DeepEP (one stream is used; the call has finished on return).

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
            EPTimeoutError: a peer did not answer within ``timeout_s``.
        """
        _check_config(config)
        return self._run(self._dispatch_steps(x, handle, num_tokens_per_rank, is_token_in_rank,
                                              num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                              num_worst_tokens, previous_event, async_finish))

    @_steps
    def _dispatch_steps(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                        topk_weights, expert_alignment, num_worst_tokens, previous_event, async_finish):
        R = self.group_size
        self.check()
        cached = handle is not None
        if not cached:
            self._dispatch_seq += 1          # the same on every rank: names the handle this call makes
        if self._sig.needs_resync:
            yield from self._resync_steps()
        try:
            a = self._dispatch_args(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                    topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event)
        except Exception as e:  # noqa: BLE001 - the peers learn it from this rank's failure word
            raise self._fail_call(e)
        # With num_worst_tokens the host never learns the counts: they stay on the device.
        worst = not cached and num_worst_tokens > 0
        # The operation (and, for a cached call, which dispatch made the handle) is part of the signature:
        # ranks that call different collectives, or pass handles of different dispatches, fail together.
        op = _OP_CACHED_DISPATCH if cached else _OP_DISPATCH
        seq = a.handle.seq if cached else 0
        sig = [op, a.row_words, a.scale_words, a.num_topk, a.flags, a.num_experts, seq, a.dtype_code]
        sc_dtype = card.dtype_code(a.scales.dtype if a.scales is not None else None)
        if cached:
            self._publish(card.CACHED_DISPATCH, (a.dtype_code, a.x.shape[1], sc_dtype, a.scale_words, seq))
        else:
            self._publish(card.DISPATCH_WORST if worst else card.DISPATCH,
                          (a.dtype_code, a.x.shape[1], sc_dtype, a.scale_words, a.num_topk,
                           int(a.topk_weights is not None), a.num_experts) + ((num_worst_tokens,) if worst else ()))
        self._begin(previous_event, async_finish)
        if cached:
            h = a.handle
            recv_rows_max, row_base = h.recv_rows_max, h.row_base
            send_pos, in_rank = h.send_head, h.is_token_in_rank
            n_recv, n_out, n_recv_dev = h.num_recv_tokens, h.num_out_rows, h.n_recv_dev
        else:
            # The counts travel on the device (notify): every rank's row of the count matrix, and for a
            # plain dispatch the per-expert counts, into every rank's header; each rank builds its
            # handle's tables from the matrix.
            if worst:
                sig.append(num_worst_tokens)       # the rounds depend on it: every rank must pass the same
            El = a.num_experts // R
            with self._comm_ctx():
                lay = self._routing(a)
            in_rank, send_pos = lay[2], lay[3]
            yield "dispatch/notify"
            with self._comm_ctx(), self._sig.watch():
                kernels.notify_send(lay[5], a.num_experts, self._sig_args, experts=not worst)
            yield "dispatch/notify receive"
            with self._comm_ctx(), self._sig.watch():
                t32_dev = torch.empty(R * R + 2 * R, dtype=torch.int32, device=self.device)
                tables = torch.empty(4 * R + 1, dtype=torch.int64, device=self.device)
                res = None
                if not worst:
                    res = self._notify_block(El)
                    self._notify_seq += 1
                kernels.notify_recv(t32_dev, tables, num_worst_tokens if worst else _MAX_ROWS, self._sig_args, res,
                                    self._notify_seq, El)
            row_base, combine_tables, n_recv_dev = tables[:R], tables[R:4 * R], tables[4 * R:]
            if worst:
                n_recv, n_out, expert_list = None, num_worst_tokens, []
                recv_rows_max, area_rows_max = num_worst_tokens, R * num_worst_tokens   # ranks receive <= it
            else:
                # The one host wait of a plain dispatch: the rows that arrive here, and per local expert.
                n_recv, recv_rows_max, area_rows_max, per_expert = self._wait_notify(El)
                n_out = n_recv
                al = a.expert_alignment
                expert_list = [(c + al - 1) // al * al for c in per_expert]

        plan = a.handle.plans.get(tuple(sig)) if cached else None
        if plan is None:
            rec_words = dispatch_record_words(a.row_words, a.scale_words, a.num_topk, with_src=not cached)
            cap = self._capacity(rec_words * 4, "dispatch")
            # rounds: from the counts, or (counts on the device only) from num_worst_tokens, equal on every rank
            rounds = max(1, -(-recv_rows_max // cap))
            plan = (rec_words, cap, rounds, signals.call_signature(sig + [rounds, rec_words]))
            if cached:
                a.handle.plans[tuple(sig)] = plan
        rec_words, cap, rounds, call_sig = plan
        dev = self.device
        xv, sc = a.x, a.scales
        H = xv.shape[1]
        recv_x = torch.empty((n_out, H), dtype=xv.dtype, device=dev)
        # scales come back with their dtype, row-major [N, S] (DeepEP allocates them with x_scales' options)
        recv_sc = torch.empty((n_out, a.scale_words), dtype=sc.dtype, device=dev) if sc is not None else None
        recv_idx = recv_w = recv_src = None
        if not cached:
            recv_src = torch.empty(n_out, dtype=torch.int32, device=dev)
            if a.num_topk:
                recv_idx = torch.empty((n_out, a.num_topk), dtype=a.topk_idx.dtype, device=dev)
                if a.topk_weights is not None:
                    recv_w = torch.empty((n_out, a.num_topk), dtype=torch.float32, device=dev)
        rec = self._comm.data.view(torch.int32)
        x_words = xv.view(torch.int32)
        sc_words = sc.view(torch.int32) if (sc is not None and a.scale_words) else None    # S = 0: nothing to move
        w_words = a.topk_weights.view(torch.int32) if (not cached and a.topk_weights is not None) else None
        idx = a.topk_idx if not cached else None
        # Rounds, each a send launch then a receive launch; ranks wait for each other on the device.
        for k in range(rounds):
            lo, hi = k * cap, (k + 1) * cap
            yield f"dispatch/send round {k}"
            with self._comm_ctx(), self._sig.watch():
                kernels.dispatch_send(x_words, sc_words, idx, w_words, send_pos, row_base, self._delta_words, rec,
                                      lo, hi, a.num_experts, rec_words, with_src=not cached, signals=self._sig_args, rnd=k,
                                      sig=call_sig)
            yield f"dispatch/receive round {k}"
            with self._comm_ctx(), self._sig.watch():
                # with the count on the device (num_worst_tokens), the kernel also writes the padding rows
                kernels.dispatch_recv(rec, min(max((n_recv if n_recv is not None else n_out) - lo, 0), cap), lo, self.rank,
                                      a.num_experts // R, a.row_words, a.scale_words,
                                      a.num_topk if not cached else 0, rec_words, recv_x.view(torch.int32),
                                      recv_sc.view(torch.int32) if sc_words is not None else None, recv_idx,
                                      recv_w.view(torch.int32) if recv_w is not None else None, recv_src,
                                      signals=self._sig_args, rnd=k, sig=call_sig,
                                      advance=rounds if k == rounds - 1 else 0,
                                      n_recv=n_recv_dev if n_recv is None else None, cap=cap)
        out_x = (recv_x, recv_sc) if sc is not None else recv_x
        inputs = (xv, sc, idx, a.topk_weights, send_pos, row_base)
        if cached:
            event = self._end(async_finish, inputs + (recv_x, recv_sc))
            self.check()
            return out_x, None, None, None, None, event
        rpm_t = t32_dev[:R * R].view(R, R)
        # DeepEP's channel_prefix_matrix and recv_channel_prefix_matrix with one channel (docs/design.md, Handle)
        chan, recv_chan = t32_dev[R * R:R * R + R].view(R, 1), t32_dev[R * R + R:].view(R, 1)
        new_handle = DispatchHandle((rpm_t, chan, recv_chan, recv_src, in_rank, send_pos), self._uid,
                                    a.num_tokens, n_recv, recv_rows_max, area_rows_max, self._dispatch_seq, row_base,
                                    combine_tables, n_recv_dev)
        event = self._end(async_finish, inputs + (recv_x, recv_sc, recv_idx, recv_w, recv_src, tables, t32_dev))
        self.check()
        return out_x, recv_idx, recv_w, expert_list, new_handle, event

    def _notify_block(self, experts_per_rank: int) -> Tensor:
        """The host-visible block a plain dispatch's notify writes its results into (int64 ``[8 + E_local]``;
        pinned host memory on GPU), grown on demand."""
        n = 8 + experts_per_rank
        if self._notify_res is None or self._notify_res.numel() < n:
            with torch.inference_mode(False):
                self._notify_res = torch.zeros(max(n, 64), dtype=torch.int64, device="cpu",
                                               pin_memory=self.device.type == "cuda")
            self._notify_np = self._notify_res.numpy()
            self._notify_seq = 0
        return self._notify_res

    def _wait_notify(self, experts_per_rank: int) -> Tuple[int, int, int, list]:
        """The host wait of a plain dispatch: poll the notify block until this call's sequence word arrives
        (no stream synchronise), bounded by ``timeout_s`` + 5 s (the kernel bounds its own waits by
        ``timeout_s``). Returns (rows received, the group's largest receive, its largest send, rows per
        local expert).

        Raises:
            what the kernels recorded (bad ids, a peer that failed, left or called another collective, a
            timeout: :meth:`check`); EPTimeoutError: the block never arrived (this rank's device is stalled).
        """
        res, want = self._notify_np, self._notify_seq
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s + 5.0
        while res[int(NT.RES_SEQ)] != want and self._sig.record() is None:
            if time.monotonic() > deadline:
                raise EPTimeoutError(self.rank, None, "dispatch/notify (the host's wait for its device)",
                                     self.timeout_s + 5.0)
            time.sleep(0)
        if self._comm.profile is not None:          # benchmarks/profile_phases.py
            t1 = time.perf_counter()
            self._comm.profile.append(("dispatch/notify (host wait)", t0, t1, t1))
        self.check()
        if res[int(NT.RES_STATUS)]:
            raise EPError(f"rank {self.rank}: the dispatch's notify stopped on an earlier error; nothing was moved")
        e0 = int(NT.RES_EXPERTS)
        return (int(res[int(NT.RES_N_RECV)]), int(res[int(NT.RES_RECV_MAX)]), int(res[int(NT.RES_SEND_MAX)]),
                res[e0:e0 + experts_per_rank].tolist())

    def _routing(self, a):
        """Layout of this call: the one ``get_dispatch_layout`` computed for this very ``topk_idx`` and
        returned as this ``is_token_in_rank`` (neither changed since), else from ``topk_idx`` by the
        kernel, else from ``is_token_in_rank``."""
        if a.topk_idx is not None:
            m = self._layout_memo
            if (m is not None and m[0]() is a.topk_idx and m[1] == _version_of(a.topk_idx) and m[2] == a.num_experts
                    and a.is_token_in_rank is m[4][2] and m[3] == _version_of(a.is_token_in_rank)):
                return m[4]
            return kernels.routing_layout(a.topk_idx, a.num_experts, self.group_size)
        in_rank = a.is_token_in_rank
        send_pos = torch.where(in_rank, in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1,
                               torch.full_like(in_rank, -1, dtype=torch.int32))      # send_head: int32, as DeepEP's
        per_rank = in_rank.sum(0, dtype=torch.int32)
        counts = torch.cat([per_rank, a.num_tokens_per_expert.to(torch.int32),
                            torch.zeros(1, dtype=torch.int32, device=per_rank.device)])     # no bad ids
        return per_rank, a.num_tokens_per_expert, in_rank, send_pos, None, counts

    def _dispatch_args(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                       topk_weights, expert_alignment, num_worst_tokens, previous_event=None) -> "DispatchArgs":
        self._live()
        R = self.group_size
        _check_event(previous_event)
        xv, sc = self._check_x(x)
        T = xv.shape[0]
        if not _isint(expert_alignment) or not 1 <= expert_alignment <= _MAX_INT32:
            raise ValueError(f"expert_alignment must be an int in [1, 2^31), got {expert_alignment!r}")
        if not _isint(num_worst_tokens) or not 0 <= num_worst_tokens <= _MAX_INT32:
            raise ValueError(f"num_worst_tokens must be an int in [0, 2^31), got {num_worst_tokens!r}")
        a = DispatchArgs(x=xv, scales=sc, num_tokens=T, row_words=xv.shape[1] * xv.element_size() // 4,
                         scale_words=sc.shape[1] if sc is not None else 0, dtype_code=_dtype_code(xv.dtype),
                         expert_alignment=int(expert_alignment))
        # scales and their dtype are in the signature: ranks must agree on both (and on their width, S)
        sflags = 0 if sc is None else (9 if sc.dtype == torch.int32 else 1)
        if handle is not None:
            h = self._check_handle(handle)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights")
            if T != h.num_tokens:
                raise ValueError(f"x has {T} rows but the handle was made for {h.num_tokens} tokens")
            a.handle, a.flags = h, 2 | sflags
            return a
        if num_tokens_per_expert is None:
            raise ValueError("num_tokens_per_expert (from get_dispatch_layout) is required without a handle")
        npe = self._check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32, torch.int64), (None,))
        E = npe.shape[0]
        self._check_num_experts(E)
        if num_tokens_per_rank is not None:
            self._check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32, torch.int64), (R,),
                               f"R = {R} ranks in the group")
        if is_token_in_rank is not None:
            a.is_token_in_rank = self._check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), (T, R),
                                                    f"T = {T} rows of x, R = {R} ranks")
        if topk_idx is not None:
            a.topk_idx = self._check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (T, None),
                                            f"T = {T} rows of x")
            a.num_topk = a.topk_idx.shape[1]
            if a.num_topk == 0:
                raise ValueError("topk_idx must have at least one column")
            if topk_weights is not None:
                a.topk_weights = self._check_tensor("topk_weights", topk_weights, (torch.float32,), (T, a.num_topk),
                                                    f"T = {T} rows of x, K = {a.num_topk} columns of topk_idx")
        elif topk_weights is not None:
            raise ValueError("topk_weights given without topk_idx")
        elif a.is_token_in_rank is None:
            raise ValueError("dispatch needs topk_idx or is_token_in_rank (or a handle) to route the tokens")
        else:
            a.num_tokens_per_expert = npe.to(torch.int32)
        a.num_experts, a.flags = E, sflags | (4 if a.topk_weights is not None else 0)
        return a

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
            EPTimeoutError: as in ``dispatch``.
        """
        _check_config(config)
        return self._run(self._combine_steps(x, handle, topk_weights, bias, previous_event, async_finish))

    @_steps
    def _combine_steps(self, x, handle, topk_weights, bias, previous_event, async_finish):
        h, xv, w, biases = None, None, None, []
        self.check()
        if self._sig.needs_resync:
            yield from self._resync_steps()
        try:
            self._live()
            _check_event(previous_event)
            h = self._check_handle(handle)
            xv = self._check_tensor("x", x, (torch.bfloat16,), (h.num_out_rows, None),
                                    f"{h.num_out_rows} rows the handle's dispatch delivered here")
            if (xv.shape[1] * 2) % 16 or xv.shape[1] == 0:
                raise ValueError(f"x rows must be a non-zero multiple of 16 bytes, got hidden {xv.shape[1]}")
            if topk_weights is not None:
                w = self._check_tensor("topk_weights", topk_weights, (torch.float32,), (h.num_out_rows, None),
                                       f"{h.num_out_rows} rows the handle's dispatch delivered here")
            bl = () if bias is None else (bias if isinstance(bias, (tuple, list)) else (bias,))
            if len(bl) > 2:
                raise ValueError(f"bias takes at most two tensors, got {len(bl)}")
            biases = [self._check_tensor(f"bias[{i}]", b, (torch.bfloat16,), (h.num_tokens, xv.shape[1]),
                                         f"the handle's {h.num_tokens} source tokens, hidden {xv.shape[1]} of x")
                      for i, b in enumerate(bl) if b is not None]
        except Exception as e:  # noqa: BLE001 - every rank learns it through the device words
            raise self._fail_call(e)
        H = xv.shape[1]
        K = w.shape[1] if w is not None else 0
        comb_base, send_base, prefix = h.combine_views
        plan = h.plans.get((_OP_COMBINE, H, K))
        if plan is None:
            rb = combine_record_bytes(H, K)
            cap = self._capacity(rb, "combine")
            rounds = max(1, -(-h.area_rows_max // cap))
            plan = h.plans[(_OP_COMBINE, H, K)] = (rb, cap, rounds,
                                                   signals.call_signature([_OP_COMBINE, H, K, h.seq, rounds]))
        rb, cap, rounds, call_sig = plan
        self._publish(card.COMBINE, (H, K, h.seq))
        self._begin(previous_event, async_finish)
        T = h.num_tokens
        out = torch.empty((T, H), dtype=torch.bfloat16, device=self.device)
        wout = torch.empty((T, K), dtype=torch.float32, device=self.device) if w is not None else None
        acc = torch.empty((T, H), dtype=torch.float32, device=self.device) if rounds > 1 else None
        wacc = torch.empty((T, K), dtype=torch.float32, device=self.device) if (rounds > 1 and K) else None
        area = self._comm.data
        x_words = xv.view(torch.int32)
        w_words = w.view(torch.int32) if w is not None else None
        # Rounds, each a send launch then a reduce launch; ranks wait for each other on the device.
        for k in range(rounds):
            lo, hi = k * cap, (k + 1) * cap
            yield f"combine/send round {k}"
            with self._comm_ctx(), self._sig.watch():
                kernels.combine_send(x_words, w_words, h.num_recv_tokens if h.num_recv_tokens is not None else h.num_out_rows,
                                     prefix, comb_base, self._delta_words, area.view(torch.int32), lo, hi, rb // 4,
                                     signals=self._sig_args, rnd=k, sig=call_sig, n_recv=h.n_recv_dev)
            yield f"combine/reduce round {k}"
            with self._comm_ctx(), self._sig.watch():
                kernels.combine_reduce(area, h.send_head, send_base, lo, hi, H, K, rb, acc, out, biases, wacc, wout,
                                       first=k == 0, last=k == rounds - 1, signals=self._sig_args, rnd=k,
                                       sig=call_sig, advance=rounds if k == rounds - 1 else 0)
        event = self._end(async_finish, (xv, w, *biases, out, wout, acc, wacc))
        self.check()
        return out, wout, event
