"""Intranode calls' checked arguments (:class:`DispatchArgs`, and the checks that make them), their handle
(:class:`DispatchHandle`, DeepEP's intranode handle) and the state one dispatch passes between its steps
(:class:`Counts`, :class:`Outputs`), and the rows a dispatch moves (:class:`Rows`, apart: only the steps that move
rows take them), for :mod:`triton_ep.modes.intranode` and the internode modes built on it.
Every check runs before anything is launched and names the argument (docs/design.md, section 3)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch

from ..kernels.geometry import fused_switch
from ..protocol import call_card as card
from ..protocol import records
from ..runtime import Runtime
from ..runtime.checks import HandleField, check_config, check_event, check_tensor, isint

Tensor = torch.Tensor
XLike = Union[Tensor, Tuple[Tensor, Tensor]]
#: the call-card operation of ``ElasticBuffer.barrier()``'s dispatch of no tokens (:data:`triton_ep.protocol.call_card.BARRIER`),
#: for ``Buffer._barrier`` (the API layer reaches the protocol layer's codes through the modes)
BARRIER = card.BARRIER

_MAX_INT32 = 2 ** 31 - 1


def check_cached_dispatch(num_rows: int, handle_tokens: int, topk_idx, topk_weights) -> None:
    """A cached dispatch (a handle given) takes no routing, and ``x`` of the handle's token count.

    Raises:
        ValueError: ``topk_idx`` / ``topk_weights`` given, or ``num_rows`` differs from ``handle_tokens``.
    """
    if topk_idx is not None or topk_weights is not None:
        raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights")
    if num_rows != handle_tokens:
        raise ValueError(f"x has {num_rows} rows but the handle was made for {handle_tokens} tokens")


def version_of(t: Tensor) -> Optional[int]:
    """A tensor's in-place version counter; ``None`` for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def card_values(a: "DispatchArgs") -> tuple:
    """A new dispatch's call-card fields (:data:`triton_ep.protocol.call_card.DISPATCH`): dtype, hidden,
    scale dtype and words, top-k, weights given, experts."""
    return (a.dtype_code, a.hidden, a.scale_dtype_code, a.scale_words, a.num_topk, int(a.topk_weights is not None),
            a.num_experts)


def cached_card_values(rows: "Rows", seq: int) -> tuple:
    """A cached dispatch's call-card fields (:data:`triton_ep.protocol.call_card.CACHED_DISPATCH`) for ``rows``:
    dtype, hidden, scale dtype and words, and ``seq``, the number of the dispatch that made the handle."""
    x, scales = rows.x, rows.scales
    return (card.dtype_code(x.dtype), x.shape[1], card.dtype_code(None if scales is None else scales.dtype),
            0 if scales is None else scales.shape[1], seq)


@dataclasses.dataclass
class Rows:
    """A dispatch's rows as :func:`check_x` gives them (DeepEP's ``x``, or its pair of 1-byte ``x`` and scales).
    Only the steps that move rows take them; the steps that need shapes read :class:`DispatchArgs`."""
    x: Tensor                       # [T, H] as the caller's dtype, contiguous
    scales: Optional[Tensor] = None     # fp32 / int32 [T, S] beside a 1-byte x, contiguous; None without

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of ``x`` (a multiple of 16)."""
        return self.x.shape[1] * self.x.element_size()

    @property
    def scale_bytes(self) -> int:
        """Bytes of one row's scales (0 without)."""
        return 0 if self.scales is None else self.scales.shape[1] * 4

    @property
    def xs(self) -> XLike:
        """``x``, or ``(x, scales)`` where there are scales (as ``dispatch`` takes and returns them)."""
        return self.x if self.scales is None else (self.x, self.scales)


@dataclasses.dataclass
class DispatchArgs:
    """One dispatch call's checked arguments (what the steps of the call read).

    The rows themselves (``x`` and its scales) are not here: only the steps that move them take them (the
    counts, the plan and the card read these shapes). ``num_tokens`` ``T`` and ``hidden`` ``H`` of ``x``
    ``[T, H]``; ``row_words`` and ``scale_words`` (``S`` of the scales ``[T, S]``, fp32 or int32, any
    ``S >= 0``, given with a 1-byte ``x`` as DeepEP; 0 without): a row and its scales in 32-bit words;
    ``dtype_code``: the dtype as the cross-rank signature carries it;
    ``topk_idx``/``topk_weights`` ``[T, K]`` or ``None``; ``is_token_in_rank`` ``[T, R]`` and
    ``num_tokens_per_expert`` ``[E]`` (int32, used only without ``topk_idx``); ``handle`` for a cached
    dispatch; ``flags``: bit 0 scales, bit 1 cached, bit 2 weights, bit 3 int32 scales (signature);
    ``scale_dtype_code``: the scales' dtype as the call card carries it (0 without scales); ``operation``: the
    call-card code of a new dispatch as the caller made it (:data:`~triton_ep.protocol.call_card.DISPATCH`, or
    :data:`~triton_ep.protocol.call_card.BARRIER` for ``ElasticBuffer.barrier()``'s dispatch of no tokens), the first
    word of its signature and of its card.
    """
    num_tokens: int
    hidden: int
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
    scale_dtype_code: int = 0
    operation: int = card.DISPATCH

    def signature(self) -> list:
        """The call's signature words (:func:`triton_ep.runtime.call_signature` of them, with the rounds and the
        record words, is checked by every rank's kernels): the operation and, for a cached call, the number of
        the dispatch that made the handle are part of it, so ranks that call different collectives, or pass
        handles of different dispatches, fail together."""
        cached = self.handle is not None
        return [card.CACHED_DISPATCH if cached else self.operation, self.row_words, self.scale_words, self.num_topk,
                self.flags, self.num_experts, self.handle.seq if cached else 0, self.dtype_code]

    def card(self, num_worst_tokens: int) -> Tuple[int, tuple]:
        """The call card this rank publishes, ``(operation code, values)``: a cached dispatch's, or a new dispatch's
        (:data:`~triton_ep.protocol.call_card.DISPATCH_WORST` with ``num_worst_tokens``: the host then never learns
        the counts, they stay on the device; else its :attr:`operation`)."""
        if self.handle is not None:
            return card.CACHED_DISPATCH, (self.dtype_code, self.hidden, self.scale_dtype_code, self.scale_words,
                                          self.handle.seq)
        return (card.DISPATCH_WORST if num_worst_tokens > 0 else self.operation), card_values(self)


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

    #: the entries, as a check of a tuple given in its place names them (``Runtime.check_handle``)
    FIELDS = (HandleField("rank_prefix_matrix", (torch.int32,)), HandleField("channel_prefix_matrix", (torch.int32,)),
              HandleField("recv_channel_prefix_matrix", (torch.int32,)), HandleField("recv_src_idx", (torch.int32,)),
              HandleField("is_token_in_rank", (torch.bool,)), HandleField("send_head", (torch.int32,)))
    DESCRIPTION = "the handle of a normal-mode dispatch within one host"

    def __new__(cls, items: tuple, buffer_uid: str, num_tokens: int, num_recv_tokens: Optional[int],
                recv_rows_max: int, area_rows_max: int, seq: int, row_base: Tensor, combine_tables: Tensor,
                n_recv_dev: Optional[Tensor] = None, num_topk: int = 0):
        self = super().__new__(cls, items)
        self.seq = seq
        #: the top-k columns of the dispatch's ``topk_idx`` (0: it took none): a combine's weights have as many
        self.num_topk = num_topk
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
        self.combine_views = records.split_combine_tables(combine_tables, R)
        #: per call shape (operation, widths): record size, rows per round, rounds and call signature,
        #: worked out by the first call of that shape
        self.plans: dict = {}
        #: the plans a cached dispatch and a combine of this handle replay (:mod:`.intranode_replay`)
        self.replay_dispatch = self.replay_combine = None
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


@dataclasses.dataclass
class Counts:
    """What a dispatch knows of its rows once the counts are exchanged (a cached one: from its handle)."""
    in_rank: Tensor                     # bool [T, R]: is_token_in_rank
    send_pos: Tensor                    # int32 [T, R]: each row's position among those sent to a rank (-1: none)
    row_base: Tensor                    # int64: where each source's rows land here (records.split_t64)
    n_recv: Optional[int]               # rows this rank receives; None: on the device only (num_worst_tokens)
    n_out: int                          # rows of the outputs (n_recv, or num_worst_tokens)
    n_recv_dev: Optional[Tensor]        # the received rows as the device counted them
    recv_rows_max: int                  # the most rows any rank receives (sets the rounds)
    area_rows_max: int = 0              # the most rows any rank sends (a combine's rounds)
    expert_list: list = dataclasses.field(default_factory=list)     # rows per local expert, aligned
    combine_tables: Optional[Tensor] = None     # int64: the combine's slices of the handle's tables
    tables: Optional[Tensor] = None             # int64 [records.t64_words(R)]: the handle's tables
    t32_dev: Optional[Tensor] = None            # int32 [records.t32_words(R)]: prefix matrices

    @classmethod
    def of_handle(cls, h: "DispatchHandle") -> "Counts":
        """A cached dispatch's counts: its handle's."""
        return cls(h.is_token_in_rank, h.send_head, h.row_base, h.num_recv_tokens, h.num_out_rows, h.n_recv_dev,
                   h.recv_rows_max)


@dataclasses.dataclass
class Outputs:
    """A dispatch's fresh outputs, and what its kernels take (32-bit words of x, scales, weights and outputs)."""
    recv_x: Tensor                      # [N, H], x's dtype
    recv_sc: Optional[Tensor]           # [N, S], the scales' dtype; None without scales
    recv_idx: Optional[Tensor]          # [N, K], topk_idx's dtype; None without topk_idx or cached
    recv_w: Optional[Tensor]            # fp32 [N, K]; None without weights or cached
    recv_src: Optional[Tensor]          # int32 [N]: each row's source token; None cached
    rec: Tensor                         # int32: the shared buffer's data area, where records land
    x_words: Tensor                     # x as the kernels move it
    sc_words: Optional[Tensor]          # the scales (None: none, or S = 0)
    w_words: Optional[Tensor]           # fp32 [T, K] weights sent (None cached)
    idx: Optional[Tensor]               # [T, K] ids sent (None cached)
    out_words: Tensor                   # recv_x as the kernels write it
    sc_out: Optional[Tensor]            # recv_sc where scales move


def check_handle(rt: Runtime, handle) -> DispatchHandle:
    """``handle`` as a cached dispatch or a combine of this Buffer takes it: a :class:`DispatchHandle` this Buffer
    made (``Runtime.check_handle``). Raises ``TypeError`` / ``ValueError`` naming the argument."""
    return rt.check_handle(handle, DispatchHandle, "dispatch")


def check_x(rt: Runtime, x: XLike) -> Rows:
    """Check ``x`` as ``dispatch`` takes it (a tensor ``[T, H]`` with rows of a multiple of 16 bytes, or
    DeepEP's pair of 1-byte ``x`` and fp32 / int32 ``scales [T, S]``): its :class:`Rows`, both
    contiguous. Raises ``TypeError`` / ``ValueError`` naming the fault."""
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
        xv = check_tensor("x[0]", x[0], (x[0].dtype,) if isinstance(x[0], torch.Tensor) else (), (None, None),
                          rt.device)
        T, H = xv.shape
        if H % 16 or H == 0:
            raise ValueError(f"x[0] rows must be a non-zero multiple of 16 bytes, got hidden {H} ({H} bytes)")
        sc = check_tensor("x[1] (scales)", x[1], (torch.float32, torch.int32), (T, None), rt.device,
                          f"T = {T} rows of x[0]")
        return Rows(xv, sc)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or an (fp8 tensor, scales) pair, got {type(x).__name__}")
    if x.is_quantized:
        raise TypeError(f"x must be a plain tensor (its rows are moved as raw bytes), got quantized {x.dtype}")
    xv = check_tensor("x", x, (x.dtype,), (None, None), rt.device)
    if (xv.shape[1] * xv.element_size()) % 16 or xv.shape[1] == 0:
        raise ValueError(f"x rows must be a non-zero multiple of 16 bytes, got hidden {xv.shape[1]} "
                         f"({xv.shape[1] * xv.element_size()} bytes)")
    return Rows(xv)


def dispatch_args(rt: Runtime, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, previous_event=None,
                  operation: int = card.DISPATCH) -> Tuple[Rows, DispatchArgs]:
    """Check ``Buffer.dispatch``'s arguments against this Buffer's group (shapes, dtypes, devices, values),
    before anything is launched (``rt``: the Buffer's runtime): the :class:`Rows` as :func:`check_x` gives them,
    and the rest (the rows' shapes included) as :class:`DispatchArgs` (``operation``: its
    :attr:`DispatchArgs.operation`). Raises ``TypeError`` / ``ValueError`` naming the argument."""
    rt.live()
    R = rt.group_size
    check_event(previous_event)
    rows = check_x(rt, x)
    xv, sc = rows.x, rows.scales
    T = xv.shape[0]
    if not isint(expert_alignment) or not 1 <= expert_alignment <= _MAX_INT32:
        raise ValueError(f"expert_alignment must be an int in [1, 2^31), got {expert_alignment!r}")
    if not isint(num_worst_tokens) or not 0 <= num_worst_tokens <= _MAX_INT32:
        raise ValueError(f"num_worst_tokens must be an int in [0, 2^31), got {num_worst_tokens!r}")
    a = DispatchArgs(num_tokens=T, hidden=xv.shape[1], row_words=rows.row_bytes // 4,
                     scale_words=sc.shape[1] if sc is not None else 0, dtype_code=card.dtype_code(xv.dtype),
                     expert_alignment=int(expert_alignment),
                     scale_dtype_code=card.dtype_code(sc.dtype if sc is not None else None), operation=operation)
    # scales and their dtype are in the signature: ranks must agree on both (and on their width, S)
    sflags = 0 if sc is None else (9 if sc.dtype == torch.int32 else 1)
    if handle is not None:
        h = check_handle(rt, handle)
        check_cached_dispatch(T, h.num_tokens, topk_idx, topk_weights)
        a.handle, a.flags = h, 2 | sflags
        return rows, a
    if num_tokens_per_expert is None:
        raise ValueError("num_tokens_per_expert (from get_dispatch_layout) is required without a handle")
    npe = rt.check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32, torch.int64), (None,))
    E = npe.shape[0]
    try:
        rt.check_num_experts(E)
    except ValueError as e:
        raise ValueError(f"num_tokens_per_expert has {E} entries, one per expert: {e}") from None
    if num_tokens_per_rank is not None:
        rt.check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32, torch.int64), (R,),
                           f"R = {R} ranks in the group")
    if is_token_in_rank is not None:
        a.is_token_in_rank = rt.check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), (T, R),
                                                f"T = {T} rows of x, R = {R} ranks")
    if topk_idx is not None:
        a.topk_idx = rt.check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (T, None),
                                        f"T = {T} rows of x")
        a.num_topk = a.topk_idx.shape[1]
        if a.num_topk == 0:
            raise ValueError("topk_idx must have at least one column")
        if topk_weights is not None:
            a.topk_weights = rt.check_tensor("topk_weights", topk_weights, (torch.float32,), (T, a.num_topk),
                                                f"T = {T} rows of x, K = {a.num_topk} columns of topk_idx")
    elif topk_weights is not None:
        raise ValueError("topk_weights given without topk_idx")
    elif a.is_token_in_rank is None:
        raise ValueError("dispatch needs topk_idx or is_token_in_rank (or a handle) to route the tokens")
    else:
        a.num_tokens_per_expert = npe.to(torch.int32)
    a.num_experts, a.flags = E, sflags | (4 if a.topk_weights is not None else 0)
    return rows, a


def combine_args(rt: Runtime, x, handle, topk_weights, bias, config, previous_event):
    """Check ``Buffer.combine``'s arguments and ``TRITON_EP_FUSED``: ``(handle, x, topk_weights or None,
    [biases], force)``. Raises ``TypeError`` / ``ValueError`` naming the argument."""
    w = None
    rt.live()
    check_config(config)
    force = fused_switch()
    check_event(previous_event)
    h = check_handle(rt, handle)
    xv = rt.check_tensor("x", x, (torch.bfloat16,), (h.num_out_rows, None),
                              f"{h.num_out_rows} rows the handle's dispatch delivered here")
    if (xv.shape[1] * 2) % 16 or xv.shape[1] == 0:
        raise ValueError(f"x rows must be a non-zero multiple of 16 bytes, got hidden {xv.shape[1]}")
    if topk_weights is not None:
        # as many columns as the dispatch's topk_idx (its recv_topk_weights' shape), where it took one
        K = h.num_topk or None
        w = rt.check_tensor("topk_weights", topk_weights, (torch.float32,), (h.num_out_rows, K),
                            f"{h.num_out_rows} rows the handle's dispatch delivered here"
                            + (f", {K} top-k columns it took" if K else ""))
    bl = () if bias is None else (bias if isinstance(bias, (tuple, list)) else (bias,))
    if len(bl) > 2:
        raise ValueError(f"bias takes at most two tensors, got {len(bl)}")
    biases = [rt.check_tensor(f"bias[{i}]", b, (torch.bfloat16,), (h.num_tokens, xv.shape[1]),
                                   f"the handle's {h.num_tokens} source tokens, hidden {xv.shape[1]} of x")
              for i, b in enumerate(bl) if b is not None]
    return h, xv, w, biases, force
