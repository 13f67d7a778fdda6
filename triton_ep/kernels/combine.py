"""Combine: return each received row to the rank it came from, then reduce per source token.

Each source rank ``i`` has, in its buffer, a *combine area* with one slot per (token, destination) pair
it sent, ordered by destination rank then by token: the rows rank ``j`` returns to ``i`` form one
contiguous block starting at ``comb_base[i] = sum(C[i][r] for r < j)``, ``C[i][r]`` being the number of
tokens ``i`` sent to ``r``. A combine record is ``[x row (H bf16) | top-k weights (K fp32)]`` padded to
16 bytes.

The reduction adds, per token and in ascending destination-rank order, the returned rows in fp32 (the
slot of token ``t`` from rank ``r`` is ``send_base[r] + send_pos[t, r]``), adds the optional biases and
rounds once to bf16. Slots grow with ``r`` for every token, so when the area is smaller than the transfer
the rounds (windows ``[lo, hi)`` of slots) visit a token's contributions in the same order, carrying an
fp32 accumulator between rounds: the result does not depend on the buffer size or block sizes.
"""
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import names
from . import flags, pdl
from ..protocol import records
from .launch import Launcher, bound
from ._util import cdiv, entry, pow2
from .geometry import defer, fused_per_sm, fused_programs, programs, row_words, sync_args, use_clock


@triton.jit
def _bf16_rtne_bits(v):
    """fp32 -> bf16 bit pattern (int16), rounding to nearest even, NaN kept NaN. Written out because
    Triton's interpreter truncates in ``.to(tl.bfloat16)``; on GPU it is the same rounding as the cast."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def _return_rows(x_ptr, w_ptr, prefix_ptr, comb_base_ptr, delta_ptr, rec_ptr, n_rows, lo, hi, WX: tl.constexpr,
                 K: tl.constexpr, REC: tl.constexpr, R: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """The combine send's data movement: this program's blocks of received rows ``[0, n_rows)``, each into
    its source rank's combine area (slots ``[lo, hi)``). ``x`` (bf16), its weights (fp32) and the area (any
    dtype) are read and written as 32-bit words."""
    x_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w_ptr = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    rec_ptr = rec_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    # Programs take row blocks pid, pid + P, ... (P = the grid: capped, kernels.geometry.programs).
    for pid in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_T), tl.num_programs(0)):
        g = tl.arange(0, BLOCK_T).to(tl.int64) + pid * BLOCK_T
        # The source rank of received row g: how many groups end at or before g.
        src = tl.zeros([BLOCK_T], dtype=tl.int64)
        for i in tl.static_range(R):
            src += (g >= tl.load(prefix_ptr + i)).to(tl.int64)
        mg = (g < n_rows) & (src < R)
        start = tl.load(prefix_ptr + src - 1, mask=mg & (src > 0), other=0)
        slot = tl.load(comb_base_ptr + src, mask=mg, other=0) + g - start
        m = mg & (slot >= lo) & (slot < hi)
        row = rec_ptr + tl.multiple_of(tl.load(delta_ptr + src, mask=m, other=0), 4) + (slot - lo) * REC
        for w0 in range(0, WX, BLOCK_W):
            ow = w0 + tl.arange(0, BLOCK_W)
            mw = m[:, None] & (ow[None, :] < WX)
            tl.store(row[:, None] + ow[None, :], tl.load(x_ptr + g[:, None] * WX + ow[None, :], mask=mw), mask=mw)
        if HAS_W:
            ok = tl.arange(0, BLOCK_K)
            mk = m[:, None] & (ok[None, :] < K)
            tl.store(row[:, None] + records.comb_weights(WX, K) + ok[None, :], tl.load(w_ptr + g[:, None] * K + ok[None, :], mask=mk), mask=mk)


@names.jit('intranode', 'combine', do_not_specialize=['n_rows', 'lo', 'hi', 'k', 'sig', 'me', 'timeout_ns'])
def _combine_send_kernel(x_ptr, w_ptr, prefix_ptr, comb_base_ptr, delta_ptr, rec_ptr, n_rows, lo, hi, n_ptr,
                         hdr, hdr_delta, host, k, sig, me, timeout_ns,
                         N_PTR: tl.constexpr, SYNC: tl.constexpr, DEFER: tl.constexpr, USE_CLOCK: tl.constexpr,
                         USE_ASM: tl.constexpr, WX: tl.constexpr, K: tl.constexpr, REC: tl.constexpr, R: tl.constexpr,
                         HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pdl.pdl_wait()      # (TRITON_EP_PDL=1: wait for the launch before, first thing; else nothing)
    if N_PTR:       # the rows received, from the device (a dispatch with num_worst_tokens)
        n_rows = tl.load(n_ptr).to(tl.int32)
    # Round n: wait until every source rank has moved round n - 1 out of its area.
    if SYNC:
        flags.release_consumed(hdr)     # (the last receive's, where it had no end-of-launch count)
        n = tl.load(hdr + flags.W_BASE) + k + 1
        go = flags.wait_peers_consumed(hdr, hdr_delta, host, n - 1, me, flags.STAGE_COMBINE_SEND, n, timeout_ns, R,
                                       USE_CLOCK)
        n_rows = tl.where(go, n_rows, 0)
    _return_rows(x_ptr, w_ptr, prefix_ptr, comb_base_ptr, delta_ptr, rec_ptr, n_rows, lo, hi, WX, K, REC, R, HAS_W,
                 BLOCK_T, BLOCK_W, BLOCK_K)
    pdl.pdl_release()   # (TRITON_EP_PDL=1: the next launch may start now; else nothing)
    # The last program tells every source rank that round n is in its area (with DEFER: the reduce launch right
    # after this one does, first thing).
    if SYNC:
        if DEFER:
            flags.defer_send(hdr, n)
        else:
            flags.finish_send(hdr, hdr_delta, n, sig, me, R, USE_ASM)


_combine_send_launch = Launcher(_combine_send_kernel, **pdl.options())


@triton.jit
def _returned_slot(send_pos_ptr, send_base_ptr, t, mt, r, lo, hi, R: tl.constexpr):
    """Where rank ``r`` returned tokens ``t``' rows in this rank's combine area: the mask (the token went
    to ``r`` and its slot lies in the round's window ``[lo, hi)``) and the slot."""
    pos = tl.load(send_pos_ptr + t * R + r, mask=mt, other=-1).to(tl.int64)    # int32 send_head, int64 slots
    slot = tl.load(send_base_ptr + r) + pos
    return (pos >= 0) & (slot >= lo) & (slot < hi), slot


@triton.jit
def _reduce_tokens(rec_h_ptr, rec_f_ptr, send_pos_ptr, send_base_ptr, T, lo, hi, acc_ptr, out_ptr, b0_ptr, b1_ptr,
                   wacc_ptr, wout_ptr, H: tl.constexpr, K: tl.constexpr, REC_H: tl.constexpr, REC_F: tl.constexpr,
                   R: tl.constexpr, LOAD_ACC: tl.constexpr, STORE_ACC: tl.constexpr, FINAL: tl.constexpr,
                   HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, load_acc=1, store_acc=1, final=1):
    """The reduce's arithmetic: this program's token blocks, the returned rows of slots ``[lo, hi)`` added in
    ascending destination rank (and, in the last round, the biases), rounded once to bf16. The area comes in
    any dtype (read as bf16 rows and fp32 weights) and ``out`` as bf16 (written as the rounded bits).
    ``LOAD_ACC``, ``STORE_ACC``, ``FINAL``: what the round may do (a split launch's round: exactly that);
    ``load_acc``, ``store_acc``, ``final``: runtime conditions on each, int32 0 or 1 (a fused launch's round, where
    one code serves every round: the first loads no sums, the last stores none)."""
    rec_h_ptr = rec_h_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    rec_f_ptr = rec_f_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    out_ptr = out_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    # Programs take token blocks pid, pid + P, ... (P = the grid: capped, kernels.geometry.programs).
    for pid in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = tl.arange(0, BLOCK_T).to(tl.int64) + pid * BLOCK_T
        mt = t < T
        for h0 in range(0, H, BLOCK_H):
            oh = h0 + tl.arange(0, BLOCK_H)
            mth = mt[:, None] & (oh[None, :] < H)
            # (a tile of the condition: the interpreter takes no scalar in a mask)
            zh = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.int32)
            l_h, s_h, f_h = (zh + load_acc) != 0, (zh + store_acc) != 0, (zh + final) != 0
            if LOAD_ACC:
                acc = tl.load(acc_ptr + t[:, None] * H + oh[None, :], mask=mth & l_h, other=0.0)
            else:
                acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for r in tl.static_range(R):
                m, slot = _returned_slot(send_pos_ptr, send_base_ptr, t, mt, r, lo, hi, R)
                v = tl.load(rec_h_ptr + (slot - lo)[:, None] * REC_H + oh[None, :], mask=m[:, None] & mth, other=0.0)
                acc += v.to(tl.float32)
            if STORE_ACC:
                tl.store(acc_ptr + t[:, None] * H + oh[None, :], acc, mask=mth & s_h)
            if FINAL:
                if HAS_B0:      # (tl.where: a -0.0 sum stays -0.0 in a round that adds no bias)
                    acc = tl.where(f_h, acc + tl.load(b0_ptr + t[:, None] * H + oh[None, :], mask=mth & f_h,
                                                      other=0.0).to(tl.float32), acc)
                if HAS_B1:
                    acc = tl.where(f_h, acc + tl.load(b1_ptr + t[:, None] * H + oh[None, :], mask=mth & f_h,
                                                      other=0.0).to(tl.float32), acc)
                tl.store(out_ptr + t[:, None] * H + oh[None, :], _bf16_rtne_bits(acc), mask=mth & f_h)
        if HAS_W:
            ok = tl.arange(0, BLOCK_K)
            mtk = mt[:, None] & (ok[None, :] < K)
            zk = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
            if LOAD_ACC:
                wacc = tl.load(wacc_ptr + t[:, None] * K + ok[None, :], mask=mtk & ((zk + load_acc) != 0), other=0.0)
            else:
                wacc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
            for r in tl.static_range(R):
                m, slot = _returned_slot(send_pos_ptr, send_base_ptr, t, mt, r, lo, hi, R)
                wacc += tl.load(rec_f_ptr + (slot - lo)[:, None] * REC_F + records.comb_weights(H // 2, K) + ok[None, :],
                                mask=m[:, None] & mtk, other=0.0)
            if STORE_ACC:
                tl.store(wacc_ptr + t[:, None] * K + ok[None, :], wacc, mask=mtk & ((zk + store_acc) != 0))
            if FINAL:
                tl.store(wout_ptr + t[:, None] * K + ok[None, :], wacc, mask=mtk & ((zk + final) != 0))


@names.jit('intranode', 'combine', do_not_specialize=['T', 'lo', 'hi', 'k', 'sig', 'me', 'timeout_ns', 'advance'])
def _combine_reduce_kernel(rec_h_ptr, rec_f_ptr, send_pos_ptr, send_base_ptr, T, lo, hi,
                           acc_ptr, out_ptr, b0_ptr, b1_ptr, wacc_ptr, wout_ptr,
                           hdr, hdr_delta, host, k, sig, me, timeout_ns, advance,
                           SYNC: tl.constexpr, DEFER: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                           H: tl.constexpr, K: tl.constexpr, REC_H: tl.constexpr, REC_F: tl.constexpr,
                           R: tl.constexpr, LOAD_ACC: tl.constexpr, STORE_ACC: tl.constexpr,
                           FINAL: tl.constexpr, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, HAS_W: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl.pdl_wait()      # (TRITON_EP_PDL=1: wait for the launch before, first thing; else nothing)
    # Round n: wait until every destination rank has returned its rows of round n here.
    if SYNC:
        if DEFER:       # the send launch just before wrote round NEXT: publish it here, then wait
            n = flags.publish_deferred(hdr, hdr_delta, sig, me, R)
        else:
            n = tl.load(hdr + flags.W_BASE) + k + 1
        go = flags.wait_peers_ready(hdr, hdr_delta, host, n, sig, me, flags.STAGE_COMBINE_RECV, n, timeout_ns, R,
                                    USE_CLOCK)
        T = tl.where(go, T, 0)
    _reduce_tokens(rec_h_ptr, rec_f_ptr, send_pos_ptr, send_base_ptr, T, lo, hi, acc_ptr, out_ptr, b0_ptr, b1_ptr,
                   wacc_ptr, wout_ptr, H, K, REC_H, REC_F, R, LOAD_ACC, STORE_ACC, FINAL, HAS_B0, HAS_B1, HAS_W, BLOCK_T,
                   BLOCK_H, BLOCK_K)
    pdl.pdl_release()   # (TRITON_EP_PDL=1: the next launch may start now; else nothing)
    # The last program frees this rank's area for round n + 1 (and ends the call's rounds); with DEFER program (0, 0)
    # ends the rounds and this rank's next send launch frees the area.
    if SYNC:
        if DEFER:
            flags.defer_recv(hdr, n, advance)
        else:
            flags.finish_recv(hdr, n, advance, USE_ASM)


_combine_reduce_launch = Launcher(_combine_reduce_kernel, **pdl.options())


@names.jit('intranode', 'combine', do_not_specialize=['n_rows', 'T', 'cap', 'sig', 'me', 'timeout_ns', 'rounds'])
def _combine_fused_kernel(x_ptr, w_ptr, prefix_ptr, comb_base_ptr, delta_ptr, rec_ptr, n_rows, n_ptr,
                          rec_h_ptr, rec_f_ptr, send_pos_ptr, send_base_ptr, T, cap, acc_ptr, out_ptr, b0_ptr, b1_ptr,
                          wacc_ptr, wout_ptr, hdr, hdr_delta, host, sig, me, timeout_ns, rounds,
                          N_PTR: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr, WX: tl.constexpr,
                          K: tl.constexpr, REC: tl.constexpr, R: tl.constexpr, HAS_W: tl.constexpr,
                          HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, SUMS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_W: tl.constexpr, BLOCK_TR: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pdl.pdl_wait()      # (TRITON_EP_PDL=1: wait for the launch before, first thing; else nothing)
    # A combine as one launch: per round (slots [k * cap, (k + 1) * cap)), the send part, then the reduce part,
    # each as its own launch does it, the fp32 sums carried between rounds in acc / wacc (SUMS: a call of several
    # rounds); programs all resident at once, waiting for each other between parts and rounds (see
    # dispatch._dispatch_fused_kernel).
    if N_PTR:
        n_rows = tl.load(n_ptr).to(tl.int32)
    flags.release_consumed(hdr)         # (the last receive's, where it had no end-of-launch count)
    base = tl.load(hdr + flags.W_BASE)  # (read before any program of this launch can advance it, in the last round)
    for k in range(rounds):
        n = base + k + 1
        lo = tl.full([], 0, tl.int64) + k * cap     # (a row index: k * cap < 2^31)
        go = flags.wait_round_free(hdr, hdr_delta, host, n, k > 0, me, flags.STAGE_COMBINE_SEND, timeout_ns, R, USE_CLOCK)
        _return_rows(x_ptr, w_ptr, prefix_ptr, comb_base_ptr, delta_ptr, rec_ptr, tl.where(go, n_rows, 0), lo,
                     lo + cap, WX, K, REC, R, HAS_W, BLOCK_T, BLOCK_W, BLOCK_K)
        flags.finish_send_fused(hdr, hdr_delta, n, sig, me, R, USE_ASM)
        go = flags.wait_own_send(hdr, hdr_delta, host, n, me, flags.STAGE_COMBINE_RECV, timeout_ns, R, USE_CLOCK)
        go = go & flags.wait_peers_ready(hdr, hdr_delta, host, n, sig, me, flags.STAGE_COMBINE_RECV, n, timeout_ns,
                                         R, USE_CLOCK)
        _reduce_tokens(rec_h_ptr, rec_f_ptr, send_pos_ptr, send_base_ptr, tl.where(go, T, 0), lo, lo + cap, acc_ptr,
                       out_ptr, b0_ptr, b1_ptr, wacc_ptr, wout_ptr, 2 * WX, K, REC * 2, REC, R, SUMS, SUMS, True,
                       HAS_B0, HAS_B1, HAS_W, BLOCK_TR, BLOCK_H, BLOCK_K, (lo > 0).to(tl.int32),
                       (lo + cap < rounds * cap).to(tl.int32), (lo + cap >= rounds * cap).to(tl.int32))
        flags.finish_recv_at(hdr, hdr + flags.W_DONE2, n, tl.where(k == rounds - 1, rounds, 0), USE_ASM)
    pdl.pdl_release()   # (TRITON_EP_PDL=1: the next launch may start now; else nothing)


_combine_fused_launch = Launcher(_combine_fused_kernel, **pdl.options())


def record_bytes(hidden: int, k: int) -> int:
    """Bytes of one combine record: ``hidden`` bf16 values and ``k`` fp32 weights, rounded up to 16."""
    return records.combine_record_bytes(hidden, k)


def combine_send(x_words: torch.Tensor, weight_words: Optional[torch.Tensor], n_rows: int, prefix: torch.Tensor,
                 comb_base: torch.Tensor, delta_words: torch.Tensor, rec: torch.Tensor, lo: int, hi: int,
                 rec_words: int, signals: Optional[dict] = None, rnd: int = 0, sig: int = 0,
                 n_recv: Optional[torch.Tensor] = None, tune: Optional[dict] = None) -> tuple:
    """Return this rank's received rows ``[0, n_rows)`` to their source ranks' combine areas (slots ``[lo, hi)``).
    Returns the bound launch and its arguments (as :func:`combine_fused`).

    Args:
        x_words: ``[N, H]`` bf16 (or its ``[N, H/2]`` int32 view), the expert outputs in receive order.
        weight_words: ``[N, K]`` fp32 (or its int32 view) or ``None``.
        n_rows: rows actually received (``N`` may include ``num_worst_tokens`` padding beyond it).
        prefix: ``[R]`` int64, column of ``rank_prefix_matrix`` for this rank (cumulative rows by source).
        comb_base: ``[R]`` int64, where this rank's block starts in each source's combine area.
        delta_words: ``[R]`` int64 peer-minus-local buffer distances in words; ``rec``: the local buffer
            (any dtype: uint8 as ``Comm.data`` holds it, or an int32 view).
        signals, rnd, sig: the round's signalling (``rnd``: the round within the call), as in
            :func:`triton_ep.kernels.dispatch.dispatch_send`.

    The launch always runs (a rank with nothing to return still releases its round). With ``n_recv``
    (int64 ``[1]`` on the device) the kernel reads the rows received from it; ``n_rows`` then only sizes
    the grid (an upper bound). ``tune``: the call's launch table (a Config's,
    :func:`triton_ep.kernels.params.of_config`), None for the built-in one; results never depend on it.
    """
    n_rows = max(n_rows, 0)
    wx = row_words(x_words)
    k = weight_words.shape[1] if weight_words is not None else 0
    cfg = entry("combine_send", tune)
    key = (programs(cdiv(n_rows, cfg["block_t"]), signals, tune=tune), wx, k, weight_words is not None, rec_words, prefix.shape[0],
           n_recv is not None, signals is not None, use_clock(signals), defer(signals), tuple(cfg.items()))
    launch = bound(_SEND_BOUND, key, lambda: _bind_send(*key[:-1], cfg))
    args = (x_words, weight_words if k else x_words, prefix, comb_base, delta_words, rec, n_rows, lo, hi,
            n_recv if n_recv is not None else prefix, *sync_args(signals, rnd, sig, x_words))
    launch(*args)
    return launch, args


_SEND_BOUND: dict = {}


def _bind_send(grid, wx, k, has_w, rec_words, R, n_ptr, sync, use_clock, defer, cfg):
    return _combine_send_launch.bind(
        (grid,), num_warps=cfg["num_warps"], N_PTR=n_ptr, SYNC=sync, DEFER=defer, USE_CLOCK=use_clock,
        USE_ASM=use_clock, WX=wx, K=k, REC=rec_words, R=R, HAS_W=has_w, BLOCK_T=cfg["block_t"],
        BLOCK_W=pow2(min(wx, cfg["block_w"])), BLOCK_K=pow2(k))


def combine_reduce(area: torch.Tensor, send_pos: torch.Tensor, send_base: torch.Tensor, lo: int, hi: int,
                   hidden: int, k: int, rec_bytes: int, acc: Optional[torch.Tensor], out: torch.Tensor,
                   biases: Sequence[torch.Tensor], wacc: Optional[torch.Tensor], wout: Optional[torch.Tensor],
                   first: bool, last: bool, signals: Optional[dict] = None, rnd: int = 0, sig: int = 0,
                   advance: int = 0, tune: Optional[dict] = None) -> tuple:
    """Add the slots ``[lo, hi)`` of the local combine area into each token's sum. Returns the bound launch and
    its arguments (as :func:`combine_fused`).

    Args:
        area: the local buffer (uint8); slots start at its first byte.
        send_pos: ``[T, R]`` int32 (the handle's ``send_head``); ``send_base``: ``[R]`` int64, slot of each
            destination's block (so slots, and the offsets from them, are int64).
        hidden, k: row width ``H`` and weights per row ``K`` (0 for none); ``rec_bytes``: record size.
        acc: ``[T, H]`` fp32 carried between rounds (``None`` when there is a single round); ``out``:
            ``[T, H]`` bf16, written in the last round (after ``biases``, each ``[T, H]`` bf16, in order).
        wacc, wout: the same for the ``[T, K]`` fp32 weights, or ``None``.
        first, last: whether this is the first / last round.
        signals, rnd, sig: the round's signalling; advance: the call's rounds in its last round, else 0.
        tune: as in :func:`combine_send`.

    The launch always runs (it frees this rank's area for the next round).
    """
    T = send_pos.shape[0]
    cfg = entry("combine_reduce", tune)
    key = (programs(cdiv(T, cfg["block_t"]), signals, tune=tune), hidden, k, rec_bytes, send_pos.shape[1], first, last,
           len(biases), wout is not None, signals is not None, use_clock(signals), defer(signals), tuple(cfg.items()))
    launch = bound(_REDUCE_BOUND, key, lambda: _bind_reduce(*key[:-1], cfg))
    b0 = biases[0] if len(biases) > 0 else out
    b1 = biases[1] if len(biases) > 1 else out
    args = (area, area, send_pos, send_base, T, lo, hi, acc if acc is not None else out, out, b0, b1,
            wacc if wacc is not None else out, wout if wout is not None else out,
            *sync_args(signals, rnd, sig, out), advance)
    launch(*args)
    return launch, args


_REDUCE_BOUND: dict = {}


def _bind_reduce(grid, hidden, k, rec_bytes, R, first, last, n_biases, has_w, sync, use_clock, defer, cfg):
    return _combine_reduce_launch.bind(
        (grid,), num_warps=cfg["num_warps"], SYNC=sync, DEFER=defer, USE_CLOCK=use_clock, USE_ASM=use_clock,
        H=hidden, K=k, REC_H=rec_bytes // 2, REC_F=rec_bytes // 4, R=R,
        LOAD_ACC=not first, STORE_ACC=not last, FINAL=last, HAS_B0=n_biases > 0, HAS_B1=n_biases > 1,
        HAS_W=has_w, BLOCK_T=cfg["block_t"], BLOCK_H=pow2(min(hidden, cfg["block_h"])), BLOCK_K=pow2(k))


def combine_fused(x_words: torch.Tensor, weight_words: Optional[torch.Tensor], n_rows: int, prefix: torch.Tensor,
                  comb_base: torch.Tensor, delta_words: torch.Tensor, area: torch.Tensor, send_pos: torch.Tensor,
                  send_base: torch.Tensor, cap: int, rec_bytes: int, out: torch.Tensor, biases: Sequence[torch.Tensor],
                  wout: Optional[torch.Tensor], signals: dict, sig: int, n_recv: Optional[torch.Tensor] = None,
                  tune: Optional[dict] = None, rounds: int = 1, acc: Optional[torch.Tensor] = None,
                  wacc: Optional[torch.Tensor] = None) -> tuple:
    """A combine of ``rounds`` rounds (round ``k``: slots ``[k * cap, (k + 1) * cap)``) as one launch: per round,
    :func:`combine_send`, then :func:`combine_reduce` (``advance = rounds`` in the last), same arguments and
    results; ``area``: the local buffer (uint8). A call of several rounds carries its fp32 sums in ``acc`` (``[T,
    H]``) and, with weights, ``wacc`` (``[T, K]``), as :func:`combine_reduce`. The grid is
    :func:`triton_ep.kernels.geometry.fused_programs`; the launch takes the send's ``num_warps`` (``tune``: as in
    :func:`combine_send`). Returns the bound launch and its arguments (for
    :meth:`triton_ep.kernels.launch.BoundLaunch.replay`).

    Raises:
        ValueError: several rounds without ``acc`` (or, with weights, ``wacc``); weights without ``wout``.
    """
    n_rows, rounds = max(n_rows, 0), max(int(rounds), 1)
    wx = row_words(x_words)
    k = weight_words.shape[1] if weight_words is not None else 0
    T = send_pos.shape[0]
    sums = rounds > 1
    if sums and (acc is None or (k and wacc is None)):
        raise ValueError("combine_fused of several rounds carries its sums in acc (and wacc with weights)")
    cs, cr, cf = entry("combine_send", tune), entry("combine_reduce", tune), entry("fused", tune)
    shape = (wx, k, weight_words is not None, rec_bytes, prefix.shape[0], n_recv is not None, len(biases),
             wout is not None, signals["use_clock"], sums, tuple(cs.items()), tuple(cr.items()), tuple(cf.items()))
    b0 = biases[0] if len(biases) > 0 else out
    b1 = biases[1] if len(biases) > 1 else out
    args = (x_words, weight_words if k else x_words, prefix, comb_base, delta_words, area, n_rows,
            n_recv if n_recv is not None else prefix, area, area, send_pos, send_base, T, cap,
            acc if sums else out, out, b0, b1, wacc if (sums and wacc is not None) else out,
            wout if wout is not None else out,
            signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"], signals["timeout_ns"], rounds)
    per_sm = fused_per_sm(lambda: _bind_fused(1, *shape[:-3], cs, cr, cf), ("combine",) + shape, args, area.device,
                          tune)
    progs = fused_programs(max(cdiv(n_rows, cs["block_t"]), cdiv(T, cr["block_t"]), 1), area.device, signals,
                           per_sm, tune=tune)
    key = (progs,) + shape
    launch = bound(_FUSED_BOUND, key, lambda: _bind_fused(*key[:-3], cs, cr, cf))
    launch(*args)
    return launch, args


_FUSED_BOUND: dict = {}


def _bind_fused(progs, wx, k, has_w, rec_bytes, R, n_ptr, n_biases, has_wout, use_clock, sums, cs, cr, cf):
    if has_w != has_wout:
        raise ValueError("combine's weights and their output come together")
    return _combine_fused_launch.bind(
        (progs,), num_warps=cs["num_warps"], N_PTR=n_ptr, USE_CLOCK=use_clock, USE_ASM=use_clock, WX=wx, K=k,
        REC=rec_bytes // 4, R=R, HAS_W=has_w, HAS_B0=n_biases > 0, HAS_B1=n_biases > 1, SUMS=sums,
        BLOCK_T=cs["block_t"],
        BLOCK_W=pow2(min(wx, cs["block_w"])), BLOCK_TR=cr["block_t"],
        BLOCK_H=pow2(min(2 * wx, cf["reduce_block_h"])),
        BLOCK_K=pow2(k))
