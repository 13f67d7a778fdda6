"""Low-latency combine: expert outputs go back to their source tokens, reduced there with the weights.

Combine is a low-latency call of its own (call ``n``, half ``n & 1`` of every rank's area; see
:mod:`.ll_dispatch`). In the source rank's half, after the counts, slot ``t * K + k`` holds the bf16 row
(``H`` values) returned for token ``t``'s entry ``k`` (the first entry of the token naming that expert); with
``use_logfmt`` the row's LogFMT-10 record instead (:mod:`.logfmt`), ``lay.logfmt_row_words`` words a slot.

1. :func:`ll_combine_send` (expert side): waits until every peer has received the call that last used
   the half, then writes each valid received row ``x[e, j]`` (``j < recv_count[e]``) into its source
   rank's slot, found in the handle's ``ret_slot``; its last program releases ``READY`` everywhere (in a
   call without a receive hook, within one host: the reduce launch does, first thing, as in a dispatch).
2. :func:`ll_combine_reduce` (the receive hook's launch, source side): waits for every peer's ``READY``
   and computes, per token, ``sum_k w[t, k] * row(t, k)`` in fp32 in ascending ``k`` (entries with
   ``-1``, a bad id or a masked rank add nothing), rounded once to bf16 (nearest even). The rank's next
   low-latency launch frees the half (no end-of-launch count here).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import names
from . import flags, ll_flags, ll_net, logfmt, pdl
from ._util import cdiv, pow2, tuning
from .launch import Launcher, bound
from .combine import _bf16_rtne_bits
from .geometry import grid2
from .ll_dispatch import recv_call, wait_recv, wait_send


@triton.jit
def combine_send_part(xw_ptr, ret_slot, count, layout, area_w, delta_w, ctl, n_max, hb, experts_per_rank, n, go,
                      ring_dw, slot_w, remote, ltab, p0, P0, p1, P1, NET: tl.constexpr, RW: tl.constexpr,
                      BLOCK_C: tl.constexpr, R: tl.constexpr, K: tl.constexpr, H: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_W: tl.constexpr, LOGFMT: tl.constexpr, LW: tl.constexpr, LB: tl.constexpr):
    """The send of combine call ``n`` (its half's rows at word ``hb``) by program ``(p0, p1)`` of ``(P0, P1)``:
    local experts ``p0``, ``p0 + P0``, ... and, of each, the row blocks ``p1``, ``p1 + P1``, ...; each valid row
    goes to its source's slot. Moves nothing unless ``go``. With ``LOGFMT`` each row goes as its LogFMT-10 record
    (:mod:`.logfmt`, ``ltab`` its log2 table; ``LB`` blocks of 128 channels of each row at a time) in slots of
    ``LW`` words, else as its bf16 words."""
    RN = R * n_max
    WX: tl.constexpr = H // 2
    SW: tl.constexpr = LW if LOGFMT else WX
    for le in range(p0, experts_per_rank, P0):
        total = tl.where(go, tl.load(count + le), 0)
        for j0 in range(p1 * BLOCK_R, total, P1 * BLOCK_R):
            j = j0 + tl.arange(0, BLOCK_R).to(tl.int64)
            m = j < total
            ret = tl.load(ret_slot + le * RN + j, mask=m, other=-1).to(tl.int64)
            m = m & (ret >= 0)
            s = tl.where(m, ret // (n_max * K), 0)
            m = m & (tl.load(ctl + flags.off_ll_mask(R) + s, mask=m, other=1) == 0)
            dst = tl.load(delta_w + s, mask=m, other=0) + hb + (ret - s * (n_max * K)) * SW
            if NET:
                # a source on the network gets its rows packed in its chunk, in the order of the records it
                # sent: after the rows of this rank's experts below le, then by index among s's rows of le
                oc = tl.arange(0, BLOCK_C)
                lr = tl.load(layout + oc[None, :] * R + s[:, None], mask=m[:, None] & (oc < le)[None, :], other=0)
                beg = tl.load(layout + le * R + s, mask=m, other=0) >> 32
                chunk = ll_net.chunk_at(ring_dw, s, ll_net.tx_chunk(ctl, s, n, R), slot_w)
                at = chunk + ll_net.NH + (tl.sum(lr & 0xFFFFFFFF, axis=1) + j - beg) * RW
                far = m & (tl.load(remote + s, mask=m, other=0) != 0)
                tl.store(area_w + at, (ret - s * (n_max * K)).to(tl.int32), mask=far)
                dst = tl.where(far, at + 4, dst)
            if LOGFMT:      # LB blocks of 128 channels at a time: the bf16 bits in, the record's words out
                xh = xw_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
                for b0 in range(0, H // logfmt.BLOCK, LB):
                    logfmt.store_rows(area_w, xh, (le * RN + j) * H, dst, m, b0, ltab, H // logfmt.BLOCK, BLOCK_R, LB)
            else:
                for w0 in range(0, WX, BLOCK_W):
                    ow = w0 + tl.arange(0, BLOCK_W)
                    mw = m[:, None] & (ow < WX)[None, :]
                    tl.store(area_w + dst[:, None] + ow[None, :],
                             tl.load(xw_ptr + (le * RN + j)[:, None] * WX + ow[None, :], mask=mw), mask=mw)


@names.jit('low_latency', 'combine', do_not_specialize=['sig', 'me', 'timeout_ns', 'ring_dw'])
def _ll_combine_send_kernel(xw_ptr, ret_slot, count, layout, area_w, delta_w, ctl, n_max, ctl_w, half_w, cnt_w,
                            experts_per_rank, hdr, hdr_delta, host, sig, me, timeout_ns, ring_ctl, ring_dw, slot_w,
                            remote, ltab, NET: tl.constexpr, RW: tl.constexpr, BLOCK_C: tl.constexpr,
                            R: tl.constexpr, K: tl.constexpr, H: tl.constexpr, SHRINK: tl.constexpr,
                            USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr, DEFER: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, LOGFMT: tl.constexpr, LW: tl.constexpr,
                            LB: tl.constexpr):
    pdl.pdl_start()
    xw_ptr = xw_ptr.to(tl.pointer_type(tl.int32), bitcast=True)        # (x bf16, moved as words)
    area_w = area_w.to(tl.pointer_type(tl.int32), bitcast=True)
    ll_flags.ll_release_cons(ctl)      # (the last receive's CONS, before this launch waits)
    n = tl.load(ctl + flags.L_SEQ) + 1
    half = n & 1
    go = wait_send(ctl, hdr, hdr_delta, host, n, me, timeout_ns, ring_ctl, remote, flags.STAGE_LL_COMBINE_SEND, R,
                   NET, SHRINK, USE_CLOCK)
    # Program (p, q) takes local experts p, p + P0, ... and of each the row blocks q, q + P1, ...
    combine_send_part(xw_ptr, ret_slot, count, layout, area_w, delta_w, ctl, n_max, ctl_w + half * half_w + cnt_w,
                      experts_per_rank, n, go, ring_dw, slot_w, remote, ltab,
                      tl.program_id(0), tl.num_programs(0), tl.program_id(1), tl.num_programs(1), NET, RW, BLOCK_C, R,
                      K, H, BLOCK_R, BLOCK_W, LOGFMT, LW, LB)
    if NET:     # each network peer's chunk: the rows this rank received from it
        ll_net.finish_send(ctl, hdr, hdr_delta, area_w, ring_ctl, ring_dw, slot_w, remote, half, n, sig, me, layout, R,
                           1, experts_per_rank, RW, 0, R, BLOCK_C, USE_ASM)
    elif DEFER:     # no end-of-launch count: the reduce launch right after this one publishes the call
        ll_flags.ll_defer_send(ctl, n)
    else:
        # The last program releases READY = n in every peer and records n as this rank's last call.
        ll_flags.ll_finish_send(ctl, hdr, hdr_delta, half, n, sig, R, me, USE_ASM)


# no fused multiply-add: the LogFMT encoding rounds every step as the reference does
_ll_combine_send_launch = Launcher(_ll_combine_send_kernel, enable_fp_fusion=False, **pdl.options())


@triton.jit
def _routes(ctl, idx_ptr, w_ptr, t, mt, num_experts, experts_per_rank, R: tl.constexpr, K: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """Per token ``t`` (where ``mt``) and entry ``k < K`` (columns of ``[BLOCK_T, BLOCK_K]``): whether
    the entry adds its row (not -1, a valid id, an unmasked rank), the slot the row came back in (``t * K`` plus
    the token's first entry naming that expert: the rank returns one row per token and expert), and the weight
    (0 where the entry adds nothing)."""
    k = tl.arange(0, BLOCK_K)
    at = t[:, None] * K + k[None, :]
    mk = mt[:, None] & (k < K)[None, :]
    e = tl.load(idx_ptr + at, mask=mk, other=-1).to(tl.int64)
    ok = mk & (e >= 0) & (e < num_experts)
    ok = ok & (tl.load(ctl + flags.off_ll_mask(R) + tl.where(ok, e // experts_per_rank, 0), mask=ok, other=1) == 0)
    same = (e[:, :, None] == e[:, None, :]) & (k[None, None, :] <= k[None, :, None])
    first = tl.min(tl.where(same, k[None, None, :], BLOCK_K), axis=2)
    return ok, t[:, None] * K + first, tl.load(w_ptr + at, mask=ok, other=0.0)


@triton.jit
def _entry(ok, slot, w, k, BLOCK_K: tl.constexpr):
    """Column ``k`` of :func:`_routes`' ``[BLOCK_T, BLOCK_K]`` tiles: ``(ok, slot, weight)`` ``[BLOCK_T]`` (each
    the column's one value, summed with zeros: exact)."""
    sel = tl.arange(0, BLOCK_K)[None, :] == k
    return (tl.sum(tl.where(sel & ok, 1, 0), axis=1) != 0, tl.sum(tl.where(sel, slot, 0), axis=1),
            tl.sum(tl.where(sel, w, 0.0), axis=1))


@triton.jit
def reduce_part(area_h, ctl, idx_ptr, w_ptr, out_ptr, T, num_experts, experts_per_rank, hb, ltab, p0, P0, p1, P1,
                R: tl.constexpr, K: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                LOGFMT: tl.constexpr, LW: tl.constexpr, BLOCK_K: tl.constexpr):
    """The reduce of the rows at element ``hb`` of the area (bf16) into ``out`` by program ``(p0, p1)`` of ``(P0,
    P1)``: token blocks ``p0``, ``p0 + P0``, ... and, of each, the hidden blocks ``p1``, ``p1 + P1``, ... With
    ``LOGFMT`` the rows are LogFMT-10 records of ``LW`` words (``BLOCK_H`` a multiple of 128: whole blocks of the
    record; ``ltab``: :func:`.logfmt.log2_table`), decoded to fp32 before the same weighted sum. ``BLOCK_K``: a
    power of two ``>= K``.

    The bf16 rows' sum is unrolled over ``k``; the LogFMT one is a loop over ``k`` (one record's decode a step,
    the routing of all ``K`` entries worked out before it): unrolled, the eight decodes of a top-8 reduce held 255
    registers a thread and spilled 272 bytes on sm_90 (128 and none as a loop), and compiled in 10-19 s on the
    2-core development CPU (1-3 s as a loop; benchmarks/logfmt_compile.py)."""
    for pid in range(p0, tl.cdiv(T, BLOCK_T), P0):
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        mt = t < T
        ok, slot, w = _routes(ctl, idx_ptr, w_ptr, t, mt, num_experts, experts_per_rank, R, K, BLOCK_K)
        for h0 in range(p1 * BLOCK_H, H, P1 * BLOCK_H):
            oh = h0 + tl.arange(0, BLOCK_H)
            acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            # Fixed order: k ascending, one fp32 multiply and add per entry.
            if LOGFMT:
                aw = area_h.to(tl.pointer_type(tl.int32), bitcast=True)
                for k in range(K):
                    okk, sk, wk = _entry(ok, slot, w, k, BLOCK_K)
                    xv = logfmt.load_rows(aw, hb // 2 + sk * LW, okk, h0 // logfmt.BLOCK, ltab, H // logfmt.BLOCK,
                                          BLOCK_T, BLOCK_H // logfmt.BLOCK)
                    acc = acc + tl.where(okk[:, None], xv * wk[:, None], 0.0)
            else:
                for k in tl.static_range(K):
                    okk, sk, wk = _entry(ok, slot, w, k, BLOCK_K)
                    xv = tl.load(area_h + hb + sk[:, None] * H + oh[None, :], mask=okk[:, None], other=0.0)
                    acc = acc + tl.where(okk[:, None], xv.to(tl.float32) * wk[:, None], 0.0)
            tl.store(out_ptr + t[:, None] * H + oh[None, :], _bf16_rtne_bits(acc), mask=mt[:, None])


@names.jit('low_latency', 'combine', do_not_specialize=['T', 'offset', 'sig', 'me', 'timeout_ns'])
def _ll_combine_reduce_kernel(area_h, ctl, idx_ptr, w_ptr, out_ptr, cost_ptr, T, offset, num_experts,
                              experts_per_rank, ctl_w, half_w, cnt_w, hdr, hdr_delta, host, sig, me, timeout_ns, ltab,
                              ring_ctl, NET: tl.constexpr, R: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                              COST: tl.constexpr,
                              SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                              DEFER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, LOGFMT: tl.constexpr,
                              LW: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl.pdl_start()
    area_h = area_h.to(tl.pointer_type(tl.bfloat16), bitcast=True)     # (the area's rows, out as bf16 bits)
    out_ptr = out_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    p = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    n = recv_call(ctl, hdr, hdr_delta, sig, me, offset, R, DEFER)
    half = n & 1
    go = wait_recv(ctl, hdr, hdr_delta, host, n, sig, me, timeout_ns, cost_ptr, p == 0,
                   flags.STAGE_LL_COMBINE_RECV, R, SHRINK, USE_CLOCK, COST, ring_ctl, NET)
    # Program (p, q) takes token blocks p, p + P0, ... and of each the hidden blocks q, q + P1, ...
    reduce_part(area_h, ctl, idx_ptr, w_ptr, out_ptr, tl.where(go, T, 0), num_experts, experts_per_rank,
                (ctl_w + half * half_w + cnt_w) * 2, ltab, tl.program_id(0), tl.num_programs(0), tl.program_id(1),
                tl.num_programs(1), R, K, H, BLOCK_T, BLOCK_H, LOGFMT, LW, BLOCK_K)
    # Program (0, 0) records the call; the rank's next low-latency launch frees the half for call n + 2.
    ll_flags.ll_finish_recv(ctl, half, n)


# no fused multiply-add: w * v is rounded, then added, as in the reference
_ll_combine_reduce_launch = Launcher(_ll_combine_reduce_kernel, enable_fp_fusion=False, **pdl.options())


def ll_combine_send(x: torch.Tensor, ret_slot: torch.Tensor, count: torch.Tensor, layout_range: torch.Tensor,
                    num_topk: int, area: torch.Tensor, delta_words: torch.Tensor, ctl: torch.Tensor, lay, sig: int,
                    shrink: bool, signals: dict, net=None, defer: bool = False, use_logfmt: bool = False) -> None:
    """Return rows ``x`` bf16 ``[E_local, R*N, H]`` (the first ``count[e]`` of each expert) to their source
    ranks' slots. ``ret_slot`` int32 ``[E_local, R*N]``: ``src * N * K + t * K + k`` or ``-1``;
    ``layout_range`` int64 ``[E_local, R]`` (the dispatch handle's); ``net``: the network leg (sources on
    other hosts get their rows in a chunk of the send ring, :mod:`.ll_net`), or None; ``defer``: no end-of-launch
    count, the call's :func:`ll_combine_reduce` (with ``defer``) comes next in the stream and publishes it (a call
    without a receive hook; not with ``net``); ``use_logfmt``: each row goes as its LogFMT-10 record
    (:mod:`.logfmt`; slots of ``lay.logfmt_row_words``, network rows of ``lay.net_logfmt_row_words``)."""
    El, RN, H = x.shape
    tune = tuning("ll_combine_send")
    key = (El, H, lay, num_topk, shrink, net is not None, signals["use_clock"], signals.get("max_programs"),
           bool(defer), bool(use_logfmt), tuple(tune.items()))
    launch = bound(_SEND_BOUND, key, lambda: _bind_send(*key[:-1], signals, tune))
    launch(x, ret_slot, count, layout_range, area, delta_words, ctl, lay.n_max, lay.ctl_words,
           lay.half_words, lay.count_words, lay.experts_per_rank, signals["hdr"], signals["hdr_delta"], signals["host"],
           sig, signals["me"], signals["timeout_ns"], *ll_net.kernel_args(net, ctl),
           logfmt.table_arg(use_logfmt, ctl))


_SEND_BOUND: dict = {}


def _bind_send(El, H, lay, num_topk, shrink, has_net, use_clock, _cap, defer, use_logfmt, signals, tune):
    if defer and has_net:
        raise ValueError("a deferred low-latency send (no receive hook) is for calls within one host")
    return _ll_combine_send_launch.bind(
        grid2(El, tune["programs_per_expert"], signals), num_warps=tune["num_warps"], NET=has_net,
        RW=lay.net_logfmt_row_words if use_logfmt else lay.net_row_words, BLOCK_C=pow2(lay.experts_per_rank),
        R=lay.num_ranks, K=num_topk, H=H, SHRINK=shrink, USE_CLOCK=use_clock, USE_ASM=use_clock, DEFER=defer,
        BLOCK_R=tune["block_r"], BLOCK_W=pow2(min(H // 2, tune["block_w"])), LOGFMT=use_logfmt,
        LW=lay.logfmt_row_words, LB=logfmt_blocks(H))


def ll_combine_reduce(area: torch.Tensor, ctl: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      out: torch.Tensor, cost: Optional[torch.Tensor], offset: int, lay, sig: int, shrink: bool,
                      signals: dict, defer: bool = False, use_logfmt: bool = False, net=None) -> None:
    """Reduce the rows returned for call ``SEQ - offset`` into ``out`` bf16 ``[T, H]`` with ``topk_weights``
    fp32 ``[T, K]`` (``topk_idx`` int32/int64 ``[T, K]``); wait ns per peer are added to ``cost`` (int64). With
    ``defer`` the call is the one the send launch just before it sent with ``defer`` (``offset`` is not used):
    this launch publishes it first (:func:`triton_ep.kernels.ll_flags.ll_publish_deferred`). ``use_logfmt``: the rows
    are LogFMT-10 records (:func:`ll_combine_send` with ``use_logfmt``). ``net``: the network leg (its waits end once
    the RDMA proxy failed), or None."""
    T, K = topk_idx.shape
    H = out.shape[1]
    tune = tuning("ll_reduce")
    key = (T, K, H, lay, cost is not None, shrink, signals["use_clock"], signals.get("max_programs"), bool(defer),
           bool(use_logfmt), net is not None, tuple(tune.items()))
    launch = bound(_REDUCE_BOUND, key, lambda: _bind_reduce(*key[:-1], signals, tune))
    launch(area, ctl, topk_idx, topk_weights, out,
           cost if cost is not None else ctl, T, offset, lay.num_experts, lay.experts_per_rank, lay.ctl_words,
           lay.half_words, lay.count_words, signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"],
           signals["timeout_ns"], logfmt.table_arg(use_logfmt, ctl), ll_net.ring_arg(net, ctl))


_REDUCE_BOUND: dict = {}


def logfmt_blocks(H: int) -> int:
    """Blocks of 128 channels a LogFMT send encodes per row at a time: 8 (1024 channels), fewer for a smaller
    ``H`` (a power of two)."""
    return min(8, pow2(H // logfmt.LOGFMT_BLOCK))


def reduce_block_h(H: int, tune: dict, use_logfmt: bool) -> int:
    """The reduce's hidden block: a power of two dividing ``H``, at most the tuning entry's ``block_h``; with
    ``use_logfmt`` at least one LogFMT block (128 channels, which divides ``H``)."""
    bh = min(pow2(H), tune["block_h"])
    while H % bh:
        bh //= 2
    return max(bh, logfmt.LOGFMT_BLOCK) if use_logfmt else bh


def _bind_reduce(T, K, H, lay, has_cost, shrink, use_clock, _cap, defer, use_logfmt, has_net, signals, tune):
    bt = tune["block_t"]
    bh = reduce_block_h(H, tune, use_logfmt)
    return _ll_combine_reduce_launch.bind(
        grid2(cdiv(T, bt), H // bh, signals), num_warps=tune["num_warps"], R=lay.num_ranks, K=K, H=H,
        COST=has_cost, SHRINK=shrink, USE_CLOCK=use_clock, USE_ASM=use_clock, DEFER=defer, BLOCK_T=bt, BLOCK_H=bh,
        LOGFMT=use_logfmt, LW=lay.logfmt_row_words, NET=has_net, BLOCK_K=pow2(K))
