"""Dispatch copy: write each token's row record into every receiver's buffer, then unpack it there.

A *record* is one received row in a receiver's buffer; its fields' offsets are the formulas of
:mod:`triton_ep.protocol.records` (``[ x row | scales | top-k ids | weight bits | source index ]``). Rows are copied as raw words, so any element type whose row
is a multiple of 4 bytes travels unchanged (bf16, fp8 e4m3, fp32 scales as their bit patterns).

Peer buffers are reached by pointer arithmetic: ``rec_ptr + delta[r]`` is rank ``r``'s buffer, where
``delta[r]`` is the distance in words from this rank's buffer to the peer's mapping of it (CUDA IPC on
GPU, a shared-memory mapping on CPU). A receiver's rows form a *window* ``[lo, hi)`` of its receive index
space: only rows inside the window are written, at ``row - lo``, so a buffer smaller than the transfer
is used in rounds. All offsets are int64.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import names
from . import flags, pdl
from ..protocol import records
from .launch import Launcher, bound
from ._util import cdiv, entry, num_sms, pow2
from .geometry import defer, fused_per_sm, fused_programs, programs, row_words, sync_args, use_clock


@triton.jit
def _dest_rows(send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr, t, mt, r, lo, hi, R: tl.constexpr, REC: tl.constexpr):
    """Where tokens ``t`` go on rank ``r``: the store mask (the token goes there and its row lies in the
    window ``[lo, hi)``) and the address of its record in rank ``r``'s buffer."""
    pos = tl.load(send_pos_ptr + t * R + r, mask=mt, other=-1).to(tl.int64)    # int32 send_head, int64 offsets
    dst = tl.load(row_base_ptr + r) + pos
    m = mt & (pos >= 0) & (dst >= lo) & (dst < hi)
    # Peer buffers sit 16-byte aligned: the hint lets the row stores be 16 bytes wide.
    row = rec_ptr + tl.multiple_of(tl.load(delta_ptr + r), 4) + (dst - lo) * REC
    return m, row


@triton.jit
def _send_tokens(x_ptr, sc_ptr, idx_ptr, w_ptr, send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr, T, lo, hi, num_experts,
                 WX: tl.constexpr, S: tl.constexpr, K: tl.constexpr, REC: tl.constexpr, R: tl.constexpr,
                 HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_SRC: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_W: tl.constexpr, EVEN_W: tl.constexpr, STORE_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr):
    """The send's data movement: this program's token blocks, each row's record into every receiver that takes
    it (the window ``[lo, hi)`` of its rows). ``x``, its scales and weights come in their own dtypes and move as
    32-bit words (no view per call on the host)."""
    x_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    sc_ptr = sc_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w_ptr = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    # Programs take token blocks pid, pid + P, ... (P = the grid; one block each unless the grid is capped).
    for pid in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = tl.arange(0, BLOCK_T).to(tl.int64) + pid * BLOCK_T
        mt = t < T
        # the tokens that go to some rank within this round's window: the only rows read (a call of several rounds
        # reads a row in the rounds that move it, not in every round; a token that goes nowhere is not read)
        go = tl.zeros([BLOCK_T], dtype=tl.int1)
        for r in tl.static_range(R):
            m, _ = _dest_rows(send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr, t, mt, r, lo, hi, R, REC)
            go = go | m
        # x: each tile is read once and stored to every destination rank that takes the token. With SPLIT_W
        # the second grid axis picks one BLOCK_W slice of the row (and slice 0 writes the record's tail).
        if SPLIT_W:
            w_begin = tl.program_id(1) * BLOCK_W
            w_end = w_begin + BLOCK_W
        else:
            w_begin = 0
            w_end = WX
        for w0 in range(w_begin, w_end, BLOCK_W):
            ow = w0 + tl.arange(0, BLOCK_W)
            src = x_ptr + t[:, None] * WX + ow[None, :]
            if EVEN_W:      # WX is a multiple of BLOCK_W: row masks only
                v = tl.load(src, mask=go[:, None])
            else:
                v = tl.load(src, mask=go[:, None] & (ow < WX)[None, :])
            for r in tl.static_range(R):
                m, row = _dest_rows(send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr, t, mt, r, lo, hi, R, REC)
                if EVEN_W:
                    mask = m[:, None]
                else:
                    mask = m[:, None] & (ow < WX)[None, :]
                tl.store(row[:, None] + ow[None, :], v, mask=mask, cache_modifier=STORE_CACHE, eviction_policy=STORE_EVICT)
        tail = mt & ((tl.zeros([BLOCK_T], dtype=tl.int32) + tl.program_id(1)) == 0)
        for r in tl.static_range(R):
            m, row = _dest_rows(send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr, t, tail, r, lo, hi, R, REC)
            if HAS_SCALES:
                os_ = tl.arange(0, BLOCK_S)
                ms = m[:, None] & (os_[None, :] < S)
                s = tl.load(sc_ptr + t[:, None] * S + os_[None, :], mask=ms)
                tl.store(row[:, None] + records.rec_scales(WX, S, K) + os_[None, :], s, mask=ms)
            if HAS_TOPK:
                ok = tl.arange(0, BLOCK_K)
                mk = m[:, None] & (ok[None, :] < K)
                ids = tl.load(idx_ptr + t[:, None] * K + ok[None, :], mask=mk, other=-1).to(tl.int64)
                ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1).to(tl.int32)
                tl.store(row[:, None] + records.rec_ids(WX, S, K) + ok[None, :], ids, mask=mk)
                if HAS_W:
                    wb = tl.load(w_ptr + t[:, None] * K + ok[None, :], mask=mk, other=0)
                    tl.store(row[:, None] + records.rec_weights(WX, S, K) + ok[None, :], wb, mask=mk)
            if HAS_SRC:
                tl.store(row + records.rec_src(WX, S, K), t.to(tl.int32), mask=m)


@names.jit('intranode', 'dispatch', do_not_specialize=['T', 'lo', 'hi', 'k', 'sig', 'me', 'timeout_ns'])
def _dispatch_send_kernel(x_ptr, sc_ptr, idx_ptr, w_ptr, send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr,
                          T, lo, hi, num_experts,
                          hdr, hdr_delta, host, k, sig, me, timeout_ns,
                          SYNC: tl.constexpr, DEFER: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                          WX: tl.constexpr, S: tl.constexpr, K: tl.constexpr, REC: tl.constexpr,
                          R: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                          HAS_W: tl.constexpr, HAS_SRC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_W: tl.constexpr, EVEN_W: tl.constexpr,
                          STORE_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr):
    pdl.pdl_wait()      # (TRITON_EP_PDL=1: wait for the launch before, first thing; else nothing)
    # Round n of the Buffer: wait until every receiver has moved round n - 1 out of its area. A program
    # that may not write (an error, now or earlier) moves nothing.
    if SYNC:
        flags.release_consumed(hdr)     # (the last receive's, where it had no end-of-launch count)
        n = tl.load(hdr + flags.W_BASE) + k + 1
        go = flags.wait_peers_consumed(hdr, hdr_delta, host, n - 1, me, flags.STAGE_DISPATCH_SEND, n, timeout_ns, R,
                                       USE_CLOCK)
        T = tl.where(go, T, 0)
    _send_tokens(x_ptr, sc_ptr, idx_ptr, w_ptr, send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr, T, lo, hi, num_experts,
                 WX, S, K, REC, R, HAS_SCALES, HAS_TOPK, HAS_W, HAS_SRC, BLOCK_T, BLOCK_W, BLOCK_S, BLOCK_K, SPLIT_W,
                 EVEN_W, STORE_CACHE, STORE_EVICT)
    pdl.pdl_release()   # (TRITON_EP_PDL=1: the next launch may start now; else nothing)
    # The launch's last program tells every receiver that round n is in its area (with DEFER: the receive launch
    # right after this one does, first thing).
    if SYNC:
        if DEFER:
            flags.defer_send(hdr, n)
        else:
            flags.finish_send(hdr, hdr_delta, n, sig, me, R, USE_ASM)


_dispatch_send_launch = Launcher(_dispatch_send_kernel, **pdl.options())


@triton.jit
def _recv_window(n_rows, n_ptr, lo, cap, go, N_PTR: tl.constexpr):
    """A receive's rows of this round: ``(unpacked, written)``. Unpacked: ``n_rows`` as given, or (``N_PTR``: a
    dispatch whose host never learns the counts, num_worst_tokens) the receive count on the device at ``n_ptr``
    less ``lo``, within ``[0, cap]`` and at most ``n_rows``; none where ``go`` is false (a wait failed). Written:
    with ``N_PTR`` all ``n_rows`` of the window (received, then padding: x 0, scales 0, ids -1, weights 0,
    source -1, written by the receive itself), else the unpacked ones."""
    n_bound = n_rows
    if N_PTR:
        n_rows = tl.minimum(tl.maximum(tl.load(n_ptr) - lo, 0), cap)
    n_rows = tl.minimum(tl.where(go, n_rows, 0), n_bound)
    if N_PTR:
        n_out = n_bound
    else:
        n_out = n_rows
    return n_rows, n_out


@triton.jit
def _recv_rows(rec_ptr, n_rows, n_out, lo, expert_lo, experts_per_rank, out_x_ptr, out_sc_ptr, out_idx_ptr, out_w_ptr,
               out_src_ptr, WX: tl.constexpr, S: tl.constexpr, K: tl.constexpr, REC: tl.constexpr,
               HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_SRC: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """The receive's data movement: this program's blocks of rows ``[0, n_out)`` of the round (rows below
    ``n_rows`` unpacked from the area, the rest padding), into output rows ``lo + i`` (outputs of any dtype,
    written as 32-bit words)."""
    out_x_ptr = out_x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    out_sc_ptr = out_sc_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    out_w_ptr = out_w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    for pid in range(tl.program_id(0), tl.cdiv(n_out, BLOCK_T), tl.num_programs(0)):
        i = tl.arange(0, BLOCK_T).to(tl.int64) + pid * BLOCK_T
        m = i < n_rows                                # rows received
        mo = i < n_out                                # rows written
        row = rec_ptr + i * REC
        out = lo + i
        for w0 in range(0, WX, BLOCK_W):
            ow = w0 + tl.arange(0, BLOCK_W)
            cw = (ow[None, :] < WX)
            tl.store(out_x_ptr + out[:, None] * WX + ow[None, :],
                     tl.load(row[:, None] + ow[None, :], mask=m[:, None] & cw, other=0), mask=mo[:, None] & cw)
        if HAS_SCALES:
            os_ = tl.arange(0, BLOCK_S)
            cs = os_[None, :] < S
            tl.store(out_sc_ptr + out[:, None] * S + os_[None, :],
                     tl.load(row[:, None] + records.rec_scales(WX, S, K) + os_[None, :], mask=m[:, None] & cs, other=0), mask=mo[:, None] & cs)
        if HAS_TOPK:
            ok = tl.arange(0, BLOCK_K)
            ck = ok[None, :] < K
            g = tl.load(row[:, None] + records.rec_ids(WX, S, K) + ok[None, :], mask=m[:, None] & ck, other=-1).to(tl.int64)
            here = (g >= expert_lo) & (g < expert_lo + experts_per_rank)
            tl.store(out_idx_ptr + out[:, None] * K + ok[None, :], tl.where(here, g - expert_lo, -1),
                     mask=mo[:, None] & ck)
            if HAS_W:
                wb = tl.load(row[:, None] + records.rec_weights(WX, S, K) + ok[None, :], mask=m[:, None] & ck, other=0)
                tl.store(out_w_ptr + out[:, None] * K + ok[None, :], tl.where(here, wb, 0), mask=mo[:, None] & ck)
        if HAS_SRC:
            tl.store(out_src_ptr + out, tl.load(row + records.rec_src(WX, S, K), mask=m, other=-1), mask=mo)


@names.jit('intranode', 'dispatch',
           do_not_specialize=['n_rows', 'lo', 'expert_lo', 'cap', 'k', 'sig', 'me', 'timeout_ns', 'advance'])
def _dispatch_recv_kernel(rec_ptr, n_rows, lo, expert_lo, experts_per_rank,
                          out_x_ptr, out_sc_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, n_ptr, cap,
                          hdr, hdr_delta, host, k, sig, me, timeout_ns, advance,
                          N_PTR: tl.constexpr, R: tl.constexpr, SYNC: tl.constexpr, DEFER: tl.constexpr,
                          USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                          WX: tl.constexpr, S: tl.constexpr, K: tl.constexpr, REC: tl.constexpr,
                          HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr,
                          HAS_SRC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pdl.pdl_wait()      # (TRITON_EP_PDL=1: wait for the launch before, first thing; else nothing)
    # Round n: wait until every sender has released it here, with the signature of this call.
    go = tl.full([], 1, tl.int1)
    if SYNC:
        if DEFER:       # the send launch just before wrote round NEXT: publish it here, then wait
            n = flags.publish_deferred(hdr, hdr_delta, sig, me, R)
        else:
            n = tl.load(hdr + flags.W_BASE) + k + 1
        go = flags.wait_peers_ready(hdr, hdr_delta, host, n, sig, me, flags.STAGE_DISPATCH_RECV, n, timeout_ns, R,
                                    USE_CLOCK)
    # The round's rows (given, or the device's count with num_worst_tokens: then padding rows too), in row
    # blocks pid, pid + P, ... (P = the grid: capped, kernels.geometry.programs).
    n_rows, n_out = _recv_window(n_rows, n_ptr, lo, cap, go, N_PTR)
    _recv_rows(rec_ptr, n_rows, n_out, lo, expert_lo, experts_per_rank, out_x_ptr, out_sc_ptr, out_idx_ptr, out_w_ptr,
               out_src_ptr, WX, S, K, REC, HAS_SCALES, HAS_TOPK, HAS_W, HAS_SRC, BLOCK_T, BLOCK_W, BLOCK_S, BLOCK_K)
    pdl.pdl_release()   # (TRITON_EP_PDL=1: the next launch may start now; else nothing)
    # The last program frees this rank's area for round n + 1 (and ends the call's rounds); with DEFER program (0, 0)
    # ends the rounds and this rank's next send launch frees the area.
    if SYNC:
        if DEFER:
            flags.defer_recv(hdr, n, advance)
        else:
            flags.finish_recv(hdr, n, advance, USE_ASM)


_dispatch_recv_launch = Launcher(_dispatch_recv_kernel, **pdl.options())


@names.jit('intranode', 'dispatch',
           do_not_specialize=['T', 'n_rows', 'expert_lo', 'cap', 'sig', 'me', 'timeout_ns', 'rounds'])
def _dispatch_fused_kernel(x_ptr, sc_ptr, idx_ptr, w_ptr, send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr,
                           T, num_experts, n_rows, expert_lo, experts_per_rank,
                           out_x_ptr, out_sc_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, n_ptr, cap,
                           hdr, hdr_delta, host, sig, me, timeout_ns, rounds,
                           N_PTR: tl.constexpr, R: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                           WX: tl.constexpr, S: tl.constexpr, K: tl.constexpr, REC: tl.constexpr,
                           HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr,
                           HAS_SRC: tl.constexpr, OUT_TOPK: tl.constexpr, OUT_W: tl.constexpr, OUT_SRC: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_TR: tl.constexpr,
                           BLOCK_WR: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_W: tl.constexpr,
                           STORE_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr):
    pdl.pdl_wait()      # (TRITON_EP_PDL=1: wait for the launch before, first thing; else nothing)
    # A call as one launch: per round (receive rows [k * cap, (k + 1) * cap)), the send part, then the receive
    # part, each as its own launch does it. The grid is capped so that every program is resident at once (a
    # receive part waits for the send part's last program, of the same launch; from the second round on, a send
    # part waits for the receive part's last program of the round before: the area is this rank's own too); the
    # send part counts its programs at W_DONE, the receive part at W_DONE2.
    flags.release_consumed(hdr)         # (the last receive's, where it had no end-of-launch count)
    base = tl.load(hdr + flags.W_BASE)  # (read before any program of this launch can advance it, in the last round)
    for k in range(rounds):
        n = base + k + 1
        lo = tl.full([], 0, tl.int64) + k * cap     # (a row index: k * cap < 2^31)
        go = flags.wait_round_free(hdr, hdr_delta, host, n, k > 0, me, flags.STAGE_DISPATCH_SEND, timeout_ns, R, USE_CLOCK)
        _send_tokens(x_ptr, sc_ptr, idx_ptr, w_ptr, send_pos_ptr, row_base_ptr, delta_ptr, rec_ptr,
                     tl.where(go, T, 0), lo, lo + cap, num_experts, WX, S, K, REC, R, HAS_SCALES, HAS_TOPK, HAS_W,
                     HAS_SRC, BLOCK_T, BLOCK_W, BLOCK_S, BLOCK_K, False, EVEN_W, STORE_CACHE, STORE_EVICT)
        flags.finish_send_fused(hdr, hdr_delta, n, sig, me, R, USE_ASM)
        go = flags.wait_own_send(hdr, hdr_delta, host, n, me, flags.STAGE_DISPATCH_RECV, timeout_ns, R, USE_CLOCK)
        go = go & flags.wait_peers_ready(hdr, hdr_delta, host, n, sig, me, flags.STAGE_DISPATCH_RECV, n, timeout_ns,
                                         R, USE_CLOCK)
        n_round, n_out = _recv_window(tl.minimum(tl.maximum(n_rows - lo, 0), cap), n_ptr, lo, cap, go, N_PTR)
        _recv_rows(rec_ptr, n_round, n_out, lo, expert_lo, experts_per_rank, out_x_ptr, out_sc_ptr, out_idx_ptr,
                   out_w_ptr, out_src_ptr, WX, S, K, REC, HAS_SCALES, OUT_TOPK, OUT_W, OUT_SRC, BLOCK_TR, BLOCK_WR,
                   BLOCK_S, BLOCK_K)
        flags.finish_recv_at(hdr, hdr + flags.W_DONE2, n, tl.where(k == rounds - 1, rounds, 0), USE_ASM)
    pdl.pdl_release()   # (TRITON_EP_PDL=1: the next launch may start now; else nothing)


_dispatch_fused_launch = Launcher(_dispatch_fused_kernel, **pdl.options())


def _blocks(cfg: dict, wx: int):
    """``(rows per block, row words per block, num_warps)`` of a send or receive entry for rows of ``wx`` words."""
    return cfg["block_t"], pow2(min(wx, cfg["block_w"])), cfg["num_warps"]


def dispatch_send(x_words: torch.Tensor, scale_words: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                  weight_words: Optional[torch.Tensor], send_pos: torch.Tensor, row_base: torch.Tensor,
                  delta_words: torch.Tensor, rec: torch.Tensor, lo: int, hi: int, num_experts: int,
                  rec_words: int, with_src: bool, signals: Optional[dict] = None, rnd: int = 0, sig: int = 0,
                  tune: Optional[dict] = None) -> tuple:
    """Write this rank's records for receive rows ``[lo, hi)`` into every receiver's buffer. Returns the bound
    launch and its arguments (as :func:`dispatch_fused`).

    Args:
        x_words: ``[T, H]`` contiguous, of any dtype whose row is whole 32-bit words (``WX`` of them): the
            rows move as raw words (an int32 view or the tensor itself, e.g. bf16 or fp8).
        scale_words: ``[T, S]`` fp32 or int32 (moved as bits) or ``None``.
        topk_idx: ``[T, K]`` int32/int64 global ids or ``None`` (cached dispatch sends no top-k).
        weight_words: ``[T, K]`` fp32 or int32 (moved as bits) or ``None``.
        send_pos: ``[T, R]`` int32 from :func:`routing_layout` (offsets from it are computed in int64).
        row_base: ``[R]`` int64, where this rank's group starts in each receiver's rows.
        delta_words: ``[R]`` int64, peer buffer minus local buffer, in words.
        rec: int32 view of the local buffer (the base every delta is relative to).
        lo, hi: the receive-row window of this round; ``rec_words``: the record width; ``with_src``:
            write the source token index (every non-cached dispatch).
        signals: :meth:`triton_ep.transport.signals.Signals.kernel_args` (``None``: the kernel alone, no
            flags, as benchmarks and single-kernel tests run it); rnd: the round within the call;
            sig: the call's signature (:func:`~triton_ep.transport.signals.call_signature`).
        tune: the call's launch table (a Config's, :func:`triton_ep.kernels.params.of_config`), None for the
            built-in one; results never depend on it.

    The launch always runs (a rank with nothing to send still releases its round).
    """
    T, wx = x_words.shape[0], row_words(x_words)
    R = send_pos.shape[1]
    s = scale_words.shape[1] if scale_words is not None else 0
    k = topk_idx.shape[1] if topk_idx is not None else 0
    cfg = entry("dispatch_send", tune)
    grid = programs(cdiv(T, cfg["block_t"]), signals, tune=tune)
    key = (T, wx, s, k, R, rec_words, scale_words is not None, topk_idx is not None, weight_words is not None,
           with_src, signals is not None, use_clock(signals), defer(signals), grid, x_words.device, tuple(cfg.items()))
    launch = bound(_SEND_BOUND, key, lambda: _bind_send(
        T, wx, s, k, R, rec_words, scale_words is not None, topk_idx is not None, weight_words is not None,
        with_src, signals, x_words.device, cfg, grid))
    dummy = x_words         # (in place of absent tensors: the kernel reads them as words, never dereferenced)
    wts = weight_words if (k and weight_words is not None) else dummy
    args = (x_words, scale_words if s else dummy, topk_idx if k else dummy, wts,
            send_pos, row_base, delta_words, rec, T, lo, hi, num_experts, *sync_args(signals, rnd, sig, x_words))
    launch(*args)
    return launch, args


_SEND_BOUND: dict = {}


def _bind_send(T, wx, s, k, R, rec_words, has_scales, has_topk, has_w, with_src, signals, device, cfg, grid):
    bt, bw, nw = _blocks(cfg, wx)
    split = bool(cfg.get("split_w", 0))
    blocks = grid
    if cfg.get("programs_per_sm", 0):
        blocks = min(blocks, int(cfg["programs_per_sm"]) * num_sms(device))
    return _dispatch_send_launch.bind(
        (blocks, cdiv(wx, bw) if split else 1), num_warps=nw, SYNC=signals is not None, DEFER=defer(signals),
        USE_CLOCK=use_clock(signals), USE_ASM=use_clock(signals),
        WX=wx, S=s, K=k, REC=rec_words, R=R, HAS_SCALES=has_scales, HAS_TOPK=has_topk,
        HAS_W=has_w, HAS_SRC=with_src, BLOCK_T=bt, BLOCK_W=bw, BLOCK_S=pow2(s), BLOCK_K=pow2(k),
        SPLIT_W=split, EVEN_W=wx % bw == 0, STORE_CACHE=cfg.get("store_cache", ""),
        STORE_EVICT=cfg.get("store_evict", ""))


def dispatch_recv(rec: torch.Tensor, n_rows: int, lo: int, rank: int, experts_per_rank: int, wx: int, s: int,
                  k: int, rec_words: int, out_x: torch.Tensor, out_scales: Optional[torch.Tensor],
                  out_idx: Optional[torch.Tensor], out_weights: Optional[torch.Tensor],
                  out_src: Optional[torch.Tensor], signals: Optional[dict] = None, rnd: int = 0, sig: int = 0,
                  advance: int = 0, n_recv: Optional[torch.Tensor] = None, cap: int = 0,
                  tune: Optional[dict] = None) -> tuple:
    """Unpack ``n_rows`` records from the local buffer into output rows ``[lo, lo + n_rows)``. Returns the bound
    launch and its arguments (as :func:`dispatch_fused`).

    Global ids become local ids of this rank (``-1`` where the expert lives elsewhere) and their weights
    0 there. ``out_x`` is ``[N, H]`` of any dtype whose row is ``WX`` 32-bit words, ``out_scales`` ``[N, S]``
    fp32 or int32, ``out_idx`` ``[N, K]`` int64 or ``None``, ``out_weights`` ``[N, K]`` fp32 or int32 (written
    as bits) or ``None``, ``out_src`` ``[N]`` int32
    or ``None``. ``k`` is 0 when the records carry no top-k. ``signals``, ``rnd``, ``sig``: as in
    :func:`dispatch_send`; ``advance``: the call's rounds in its last round (the round counter moves on), else 0.
    The launch always runs (it frees this rank's area for the next round). With ``n_recv`` (int64 ``[1]``
    on the device: the rows this rank receives in all) the rows of the round are ``clamp(n_recv - lo, 0,
    cap)``, worked out by the kernel; ``n_rows`` is then only an upper bound that sizes the grid. ``tune``: as in
    :func:`dispatch_send`.
    """
    n_rows = max(n_rows, 0)
    dummy = out_x
    has_topk = out_idx is not None
    cfg = entry("dispatch_recv", tune)
    grid = programs(cdiv(n_rows, cfg["block_t"]), signals, tune=tune)
    key = (grid, wx, s, k, rec_words, n_recv is not None, out_scales is not None, has_topk, out_weights is not None,
           out_src is not None, signals is not None, use_clock(signals), defer(signals),
           signals["hdr_delta"].shape[0] if signals is not None else 1, tuple(cfg.items()))
    launch = bound(_RECV_BOUND, key, lambda: _bind_recv(grid, *key[1:-1], cfg))
    args = (rec, n_rows, lo, rank * experts_per_rank, experts_per_rank,
            out_x, out_scales if out_scales is not None else dummy, out_idx if has_topk else dummy,
            out_weights if out_weights is not None else dummy, out_src if out_src is not None else dummy,
            n_recv if n_recv is not None else rec, cap, *sync_args(signals, rnd, sig, rec), advance)
    launch(*args)
    return launch, args


_RECV_BOUND: dict = {}


def _bind_recv(grid, wx, s, k, rec_words, n_ptr, has_scales, has_topk, has_w, has_src, sync, use_clock, defer, R, cfg):
    bt, bw, nw = _blocks(cfg, wx)
    return _dispatch_recv_launch.bind(
        (grid,), num_warps=nw, N_PTR=n_ptr, R=R, SYNC=sync, DEFER=defer, USE_CLOCK=use_clock, USE_ASM=use_clock,
        WX=wx, S=s, K=k, REC=rec_words, HAS_SCALES=has_scales, HAS_TOPK=has_topk,
        HAS_W=has_w, HAS_SRC=has_src, BLOCK_T=bt, BLOCK_W=bw, BLOCK_S=pow2(s), BLOCK_K=pow2(k))


def dispatch_fused(x_words: torch.Tensor, scale_words: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                   weight_words: Optional[torch.Tensor], send_pos: torch.Tensor, row_base: torch.Tensor,
                   delta_words: torch.Tensor, rec: torch.Tensor, num_experts: int, rec_words: int, with_src: bool,
                   n_rows: int, rank: int, experts_per_rank: int, k_out: int, out_x: torch.Tensor,
                   out_scales: Optional[torch.Tensor], out_idx: Optional[torch.Tensor],
                   out_weights: Optional[torch.Tensor], out_src: Optional[torch.Tensor], signals: dict, sig: int,
                   n_recv: Optional[torch.Tensor] = None, cap: int = 0, tune: Optional[dict] = None,
                   rounds: int = 1) -> tuple:
    """A call of ``rounds`` rounds (round ``k``: receive rows ``[k * cap, (k + 1) * cap)``) as one launch: per round,
    :func:`dispatch_send`, then :func:`dispatch_recv` (``advance = rounds`` in the last), same arguments and results
    (``k_out``: the receive's ``k``; ``n_rows``: the rows received in all, or with ``n_recv`` their bound). Its
    programs wait for each other between the parts (and between rounds), so the grid is :func:`fused_programs`;
    the launch takes the send's ``num_warps`` and each part its own blocks (``tune``: as in :func:`dispatch_send`).
    Returns the bound launch and its arguments (:meth:`triton_ep.kernels.launch.BoundLaunch.replay` plans a later
    call of the same shapes from them)."""
    T, wx = x_words.shape[0], row_words(x_words)
    R = send_pos.shape[1]
    s = scale_words.shape[1] if scale_words is not None else 0
    k = topk_idx.shape[1] if topk_idx is not None else 0
    if (scale_words is None) != (out_scales is None):
        raise ValueError("dispatch_fused moves scales only with both scale_words and out_scales")
    n_rows, rounds = max(n_rows, 0), max(int(rounds), 1)
    cs, cr = entry("dispatch_send", tune), entry("dispatch_recv", tune)
    shape = (wx, s, k, k_out, R, rec_words, scale_words is not None, topk_idx is not None,
             weight_words is not None, with_src, n_recv is not None, out_idx is not None, out_weights is not None,
             out_src is not None, signals["use_clock"], tuple(cs.items()), tuple(cr.items()))
    dummy = x_words
    wts = weight_words if (k and weight_words is not None) else dummy
    args = (x_words, scale_words if s else dummy, topk_idx if k else dummy, wts,
            send_pos, row_base, delta_words, rec, T, num_experts, n_rows, rank * experts_per_rank,
            experts_per_rank, out_x, out_scales if out_scales is not None else dummy,
            out_idx if out_idx is not None else dummy, out_weights if out_weights is not None else dummy,
            out_src if out_src is not None else dummy, n_recv if n_recv is not None else rec, cap,
            signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"], signals["timeout_ns"], rounds)
    per_sm = fused_per_sm(lambda: _bind_fused(1, *shape[:-2], cs, cr), ("dispatch",) + shape, args, rec.device, tune)
    progs = fused_programs(max(cdiv(T, cs["block_t"]), cdiv(min(n_rows, cap), cr["block_t"]), 1), rec.device,
                           signals, per_sm, tune=tune)
    key = (progs,) + shape
    launch = bound(_FUSED_BOUND, key, lambda: _bind_fused(*key[:-2], cs, cr))
    launch(*args)
    return launch, args


_FUSED_BOUND: dict = {}


def _bind_fused(progs, wx, s, k, k_out, R, rec_words, has_scales, has_topk, has_w, with_src, n_ptr, out_topk, out_w,
                out_src, use_clock, cs, cr):
    bt, bw, nw = _blocks(cs, wx)
    btr, bwr, _ = _blocks(cr, wx)
    if k_out != k:
        raise ValueError(f"the send's records carry {k} top-k columns but the receive reads {k_out}")
    return _dispatch_fused_launch.bind(
        (progs,), num_warps=nw, N_PTR=n_ptr, R=R, USE_CLOCK=use_clock, USE_ASM=use_clock, WX=wx, S=s, K=k,
        REC=rec_words, HAS_SCALES=has_scales, HAS_TOPK=has_topk, HAS_W=has_w, HAS_SRC=with_src,
        OUT_TOPK=out_topk, OUT_W=out_w, OUT_SRC=out_src, BLOCK_T=bt, BLOCK_W=bw, BLOCK_TR=btr, BLOCK_WR=bwr,
        BLOCK_S=pow2(s), BLOCK_K=pow2(k), EVEN_W=wx % bw == 0, STORE_CACHE=cs.get("store_cache", ""),
        STORE_EVICT=cs.get("store_evict", ""))
