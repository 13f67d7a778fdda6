"""Low-latency dispatch: every (token, expert) pair becomes one row in the expert's rank, expert-major.

Each rank's low-latency area (mapped by every rank, :mod:`triton_ep.modes.low_latency` sizes it) holds a
control block (:mod:`.flags`, ``L_*`` words) and two *halves*; low-latency call ``n`` uses half ``n & 1``.
A half starts with the counts, int32 ``[R][E_local]`` (rows rank ``s`` sends to each local expert), then
holds the row *records* ``[E_local][R][N]``: record ``(e, s, i)`` is the ``i``-th row rank ``s`` sends to
local expert ``e``, in 32-bit words::

    [ payload (bf16 row: H/2 words; or fp8 row: H/4 words + H/128 fp32 scales) | t * K + k ]

padded to 4 words, where ``t`` is the source token and ``k`` its first top-k entry naming that expert.
The three launches of one dispatch:

1. :func:`ll_route` (a program per expert, or per few): the slot of each (token, expert) pair among this rank's
   rows for the expert, in token order (deterministic), the rows per expert, masked ids (``-1``, a masked rank,
   duplicates of an earlier entry of the same token: the row goes once); bad ids end the call with an
   error record.
2. :func:`ll_dispatch_send`: waits until every peer has received the call that last used this half,
   casts rows to FP8 if asked, writes each record straight into the expert's rank, then the counts; its
   last program releases ``READY`` in every peer and advances this rank's call number. In a call without
   a receive hook, within one host, the send has no end-of-launch count: it records the call (``NEXT``) and
   the receive launch, next in the stream, publishes it first thing (:func:`.ll_flags.ll_publish_deferred`).
3. :func:`ll_dispatch_recv` (the receive hook's launch): waits for every peer's ``READY``, packs the
   records expert-major into fresh outputs (rows of source ranks in rank order, each in its token order),
   and fills DeepEP's handle tables. It has no end-of-launch count: the rank's next low-latency launch frees
   the half for call ``n + 2`` (:func:`.ll_flags.ll_finish_recv`).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import names
from . import flags, ll_flags, ll_net, pdl
from ..protocol import records
from ._util import cdiv, pow2, tuning
from .geometry import grid2, row_words
from .launch import Launcher, bound
from .fp8 import quantize_blocks


@triton.jit
def route_part(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank, hdr, hdr_delta, host, me, p, P,
               R: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_E: tl.constexpr, ONE: tl.constexpr):
    """The route of :func:`ll_route` done by program ``p`` of ``P``: expert blocks ``p``, ``p + P``, ... (with
    ``ONE``, a grid of a program per block: block ``p`` alone, no loop)."""
    if ONE:
        _route_block(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank, hdr, hdr_delta, host, me, p,
                     R, K, BLOCK_T, BLOCK_K, BLOCK_E)
    else:
        for eb in range(p, tl.cdiv(num_experts, BLOCK_E), P):
            _route_block(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank, hdr, hdr_delta, host, me,
                         eb, R, K, BLOCK_T, BLOCK_K, BLOCK_E)


@triton.jit
def _route_block(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank, hdr, hdr_delta, host, me, eb,
                 R: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """Route expert block ``eb``."""
    # The program owning an expert block alone writes its counts and the slots of the entries naming its experts,
    # so the programs need no ordering among themselves; the owner of block 0 also writes -1 for the entries naming
    # no expert (-1, or a bad id: counted).
    ok_ = tl.arange(0, BLOCK_K)
    oe = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    me_ = oe < num_experts
    # an expert of a masked rank gets no rows
    live = me_ & (tl.load(ctl + flags.off_ll_mask(R) + tl.where(me_, oe // experts_per_rank, 0), mask=me_,
                          other=1) == 0)
    running = tl.zeros([BLOCK_E], dtype=tl.int32)       # rows of earlier token blocks, per owned expert
    nbad = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        m = (t < T)[:, None] & (ok_ < K)[None, :]
        of = t[:, None] * K + ok_[None, :]
        ids = tl.load(idx_ptr + of, mask=m, other=-1)
        hit = (m[:, :, None] & (ids[:, :, None] == oe[None, None, :])).to(tl.int32)      # [T, K, E]
        # the token's first entry naming an expert makes its row (a duplicate of it makes none)
        first = (hit == 1) & ((tl.cumsum(hit, axis=1) - hit) == 0)
        onehot = tl.max(first.to(tl.int32), axis=1)                                     # [T, E]
        # slot = rows for the expert from earlier tokens (slots follow token order)
        before = tl.cumsum(onehot, axis=0) - onehot + running[None, :]
        row = first & live[None, None, :]
        slot = tl.sum(tl.where(row, before[:, None, :], 0), axis=2)                       # [T, K]
        slot = tl.where(tl.max(row.to(tl.int32), axis=2) == 1, slot, -1)
        tl.store(slot_ptr + of, slot, mask=tl.max(hit, axis=2) == 1)
        running += tl.sum(onehot, axis=0)
        if eb == 0:
            nbad += tl.sum((m & ((ids < -1) | (ids >= num_experts))).to(tl.int32))
            tl.store(slot_ptr + of, tl.full([BLOCK_T, BLOCK_K], -1, tl.int32),
                     mask=m & ((ids < 0) | (ids >= num_experts)))
    tl.store(cnt_ptr + oe, tl.where(live, running, 0), mask=me_)
    # Bad ids: nothing is sent (the send sees the error) and every peer is told that this call (the next one
    # this rank sends) failed.
    if (eb == 0) & (nbad > 0):
        tl.store(host + flags.H_INFO, nbad.to(tl.int64))
        tl.store(host + flags.H_INFO2, tl.full([], 0, tl.int64) + num_experts)
        flags.post_error(hdr, hdr_delta, host, flags.E_BADIDS, me, flags.STAGE_LL_DISPATCH_SEND,
                         tl.load(hdr + flags.W_BASE) + 1, me, R, ctl, tl.load(ctl + flags.L_SEQ) + 1)


@names.jit('low_latency', 'route', do_not_specialize=['T', 'me'])
def _ll_route_kernel(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank,
                     hdr, hdr_delta, host, me, R: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    pdl.pdl_start()
    ll_flags.ll_release_cons(ctl)      # (a dispatch's first launch: the last receive's CONS, before the send waits)
    route_part(idx_ptr, slot_ptr, cnt_ptr, ctl, T, num_experts, experts_per_rank, hdr, hdr_delta, host, me,
               tl.program_id(0), tl.num_programs(0), R, K, BLOCK_T, BLOCK_K, BLOCK_E, True)


_ll_route_launch = Launcher(_ll_route_kernel, **pdl.options())


@triton.jit
def _records_of(slot_ptr, idx_ptr, cnt_ptr, delta_w, ctl, t, mt, experts_per_rank, records_w, me, n_max, k_net,
                ring_dw, slot_w, remote, K: tl.constexpr, R: tl.constexpr, REC: tl.constexpr, BLOCK_K: tl.constexpr,
                NET: tl.constexpr, CW: tl.constexpr, BLOCK_C: tl.constexpr):
    """Where the entries of tokens ``t`` go: ``[BLOCK_T, BLOCK_K]`` masks (the entry has a slot) and word
    addresses, relative to this rank's area, of their records ``(local expert, me, slot)`` in the expert's
    rank's area, whose records start at word ``records_w`` of the half. With ``NET`` a rank on the network
    (``remote[d]``) gets its records packed by expert into its chunk of call ``k_net`` in the send ring (at
    word ``ring_dw``)."""
    k = tl.arange(0, BLOCK_K)
    mk = mt[:, None] & (k < K)[None, :]
    of = t[:, None] * K + k[None, :]
    sl = tl.load(slot_ptr + of, mask=mk, other=-1)
    m = mk & (sl >= 0)
    e = tl.where(m, tl.load(idx_ptr + of, mask=m, other=0).to(tl.int64), 0)
    d = e // experts_per_rank
    rec = tl.load(delta_w + d, mask=m, other=0) + records_w + (((e - d * experts_per_rank) * R + me) * n_max + sl) * REC
    if NET:
        pre = ll_net.rows_before(cnt_ptr, d * experts_per_rank, e - d * experts_per_rank, experts_per_rank, BLOCK_C)
        chunk = ll_net.chunk_at(ring_dw, d, ll_net.tx_chunk(ctl, d, k_net, R), slot_w)
        net = chunk + ll_net.NH + CW + (pre + sl) * REC
        rec = tl.where(tl.load(remote + d, mask=m, other=0) != 0, net, rec)
    return m, rec, of


@triton.jit
def typed_area(area_w, area_q, area_f, NATIVE: tl.constexpr):
    """The area as 32-bit words, FP8 bytes (``float8e4nv``, or ``uint8`` without a native cast) and fp32 scales:
    typed inside the kernel, not by views on the host."""
    area_w = area_w.to(tl.pointer_type(tl.int32), bitcast=True)
    if NATIVE:
        area_q = area_q.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    else:
        area_q = area_q.to(tl.pointer_type(tl.uint8), bitcast=True)
    area_f = area_f.to(tl.pointer_type(tl.float32), bitcast=True)
    return area_w, area_q, area_f


@triton.jit
def send_part(x_ptr, xw_ptr, idx_ptr, slot_ptr, cnt_ptr, area_w, area_q, area_f, delta_w, ctl, T, num_experts,
              experts_per_rank, n_max, hb, cnt_w, n, go, me, ring_dw, slot_w, remote, p0, P0, p1, P1,
              NET: tl.constexpr, CW: tl.constexpr, BLOCK_C: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
              H: tl.constexpr, PW: tl.constexpr, SW: tl.constexpr, REC: tl.constexpr, FP8: tl.constexpr,
              ROUND_SCALE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """The send of call ``n`` (half at word ``hb``) by program ``(p0, p1)`` of ``(P0, P1)``: token blocks ``p0``,
    ``p0 + P0``, ... and, of each, the hidden blocks ``p1``, ``p1 + P1``, ...; then program ``(0, 0)`` sends the
    counts. Moves nothing unless ``go``."""
    T = tl.where(go, T, 0)
    # Each tile of x is read (and cast) once and stored into the record of every expert the token goes to.
    for pid in range(p0, tl.cdiv(T, BLOCK_T), P0):
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        mt = t < T
        m, rec, of = _records_of(slot_ptr, idx_ptr, cnt_ptr, delta_w, ctl, t, mt, experts_per_rank, hb + cnt_w, me,
                                 n_max, n, ring_dw, slot_w, remote, K, R, REC, BLOCK_K, NET, CW, BLOCK_C)
        for h0 in range(p1 * BLOCK_H, H, P1 * BLOCK_H):
            oh = h0 + tl.arange(0, BLOCK_H)
            if FP8:
                xv = tl.load(x_ptr + t[:, None] * H + oh[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
                q, s = quantize_blocks(xv, ROUND_SCALE, NATIVE, BLOCK_T, BLOCK_H)
                if not NATIVE:
                    q = q.to(tl.uint8)
                ob = h0 // 128 + tl.arange(0, BLOCK_H // 128)
                tl.store(area_q + rec[:, :, None] * 4 + oh[None, None, :],
                         tl.broadcast_to(q[:, None, :], [BLOCK_T, BLOCK_K, BLOCK_H]), mask=m[:, :, None])
                tl.store(area_f + rec[:, :, None] + PW + ob[None, None, :],            # scales after the payload
                         tl.broadcast_to(s[:, None, :], [BLOCK_T, BLOCK_K, BLOCK_H // 128]), mask=m[:, :, None])
            else:
                ow = h0 // 2 + tl.arange(0, BLOCK_H // 2)
                xr = tl.load(xw_ptr + t[:, None] * (H // 2) + ow[None, :], mask=mt[:, None])
                tl.store(area_w + rec[:, :, None] + ow[None, None, :],
                         tl.broadcast_to(xr[:, None, :], [BLOCK_T, BLOCK_K, BLOCK_H // 2]), mask=m[:, :, None])
        # the record's last word: t * K + k (the entry combine returns the row to)
        if p1 == 0:
            tl.store(area_w + rec + records.ll_rec_slot(PW, SW), of.to(tl.int32), mask=m)
    # The rows per expert go to the expert's rank: counts [s = me][local expert] of the half there.
    if (p0 == 0) & (p1 == 0) & go:
        for e0 in range(0, num_experts, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E).to(tl.int64)
            me_ = e < num_experts
            d = tl.where(me_, e // experts_per_rank, 0)
            me_ = me_ & (tl.load(ctl + flags.off_ll_mask(R) + d, mask=me_, other=1) == 0)
            at = tl.load(delta_w + d, mask=me_, other=0) + hb + me * experts_per_rank + (e - d * experts_per_rank)
            if NET:     # a rank on the network gets its counts at the head of its chunk
                chunk = ll_net.chunk_at(ring_dw, d, ll_net.tx_chunk(ctl, d, n, R), slot_w)
                at = tl.where(tl.load(remote + d, mask=me_, other=0) != 0,
                              chunk + ll_net.NH + (e - d * experts_per_rank), at)
            tl.store(area_w + at, tl.load(cnt_ptr + e, mask=me_, other=0), mask=me_)


@triton.jit
def wait_send(ctl, hdr, hdr_delta, host, n, me, timeout_ns, ring_ctl, remote, stage, R: tl.constexpr,
              NET: tl.constexpr, SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr):
    """Before a send of call ``n`` (dispatch or combine): it uses half ``n & 1``; wait until every peer has
    received call ``n - 2``, the half's last user (with ``NET``, also until the send ring's slots are free; every
    wait ends once the RDMA proxy failed: :func:`ll_net.abort_word`). Returns True when the program may move data."""
    go = ll_flags.ll_wait_peers(ctl, hdr, hdr_delta, host, flags.L_CONS + (n & 1), n - 2, 0, me, stage, timeout_ns,
                             R=R, REMOTE=True, CHECK_SIG=False, SHRINK=SHRINK, USE_CLOCK=USE_CLOCK, COST=False,
                             abort=ll_net.abort_word(ring_ctl, NET))
    if NET:     # ranks on the network: each one's chunk k reuses the send slot of its chunk k - 2, once placed
        go = go & ll_net.wait_slots(ring_ctl, remote, hdr, hdr_delta, host, n, me, stage, timeout_ns, R, USE_CLOCK,
                                    ctl, SHRINK)
    return go


@names.jit('low_latency', 'dispatch', do_not_specialize=['T', 'sig', 'me', 'timeout_ns', 'ring_dw'])
def _ll_dispatch_send_kernel(x_ptr, xw_ptr, idx_ptr, slot_ptr, cnt_ptr, area_w, area_q, area_f, delta_w, ctl,
                             T, num_experts, experts_per_rank, n_max, ctl_w, half_w, cnt_w,
                             hdr, hdr_delta, host, sig, me, timeout_ns, ring_ctl, ring_dw, slot_w, remote,
                             NET: tl.constexpr, CW: tl.constexpr, BLOCK_C: tl.constexpr, R: tl.constexpr,
                             K: tl.constexpr, H: tl.constexpr, PW: tl.constexpr,
                             SW: tl.constexpr, REC: tl.constexpr, FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, NATIVE: tl.constexpr,
                             SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                             DEFER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    pdl.pdl_start()
    xw_ptr = xw_ptr.to(tl.pointer_type(tl.int32), bitcast=True)      # (x as words)
    area_w, area_q, area_f = typed_area(area_w, area_q, area_f, NATIVE)
    n = tl.load(ctl + flags.L_SEQ) + 1
    half = n & 1
    go = wait_send(ctl, hdr, hdr_delta, host, n, me, timeout_ns, ring_ctl, remote, flags.STAGE_LL_DISPATCH_SEND, R,
                   NET, SHRINK, USE_CLOCK)
    # Program (p, q) takes token blocks p, p + P0, ... and, of each, the hidden blocks q, q + P1, ...
    send_part(x_ptr, xw_ptr, idx_ptr, slot_ptr, cnt_ptr, area_w, area_q, area_f, delta_w, ctl, T, num_experts,
              experts_per_rank, n_max, ctl_w + half * half_w, cnt_w, n, go, me, ring_dw, slot_w, remote,
              tl.program_id(0), tl.num_programs(0), tl.program_id(1), tl.num_programs(1), NET, CW, BLOCK_C, R, K, H, PW,
              SW, REC, FP8, ROUND_SCALE, NATIVE, BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_E)
    if NET:     # each network peer's chunk: the counts of its experts, then their records
        ll_net.finish_send(ctl, hdr, hdr_delta, area_w, ring_ctl, ring_dw, slot_w, remote, half, n, sig, me, cnt_ptr,
                           1, experts_per_rank, experts_per_rank, REC, CW, R, BLOCK_C, USE_ASM)
    elif DEFER:     # no end-of-launch count: the receive launch right after this one publishes the call
        ll_flags.ll_defer_send(ctl, n)
    else:
        # The last program releases READY = n in every peer and records n as this rank's last call.
        ll_flags.ll_finish_send(ctl, hdr, hdr_delta, half, n, sig, R, me, USE_ASM)


_ll_dispatch_send_launch = Launcher(_ll_dispatch_send_kernel, **pdl.options())


@triton.jit
def recv_part(area_w, ctl, out_w, out_s, src_info, ret_slot, layout, count, stats_ptr, n_max, hb, cnt_w,
              experts_per_rank, go, p0, P0, b, NB, R: tl.constexpr, K: tl.constexpr, PW: tl.constexpr, SW: tl.constexpr,
              REC: tl.constexpr, UE8M0: tl.constexpr, STATS: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr):
    """The receive of the half at word ``hb`` by program ``(p0, b)`` of ``(P0, NB)``: local experts ``p0``,
    ``p0 + P0``, ... and, of each, the row blocks ``b``, ``b + NB``, ... Moves nothing unless ``go`` (the counts then
    read as 0)."""
    RN = R * n_max
    for le in range(p0, experts_per_rank, P0):
        # Rows per source rank for this expert (none from a masked rank, or after an error), packed in rank
        # order: DeepEP's layout_range = begin << 32 | count.
        total = tl.zeros([], dtype=tl.int64)
        for s in tl.static_range(R):
            ok = go & (tl.load(ctl + flags.off_ll_mask(R) + s, volatile=True) == 0)
            c = tl.where(ok, tl.load(area_w + hb + s * experts_per_rank + le, volatile=True), 0).to(tl.int64)
            if b == 0:
                tl.store(layout + le * R + s, (total << 32) | c)
            total += c
        if b == 0:
            tl.store(count + le, total.to(tl.int32))
            if STATS:
                tl.store(stats_ptr + le, tl.load(stats_ptr + le) + total.to(tl.int32))
        # The received rows, blocks of BLOCK_R spread over the expert's programs.
        for j0 in range(b * BLOCK_R, total, NB * BLOCK_R):
            j = j0 + tl.arange(0, BLOCK_R).to(tl.int64)
            valid = j < total
            # the source rank and index of row j
            src = tl.zeros([BLOCK_R], dtype=tl.int64)
            i = tl.zeros([BLOCK_R], dtype=tl.int64)
            beg = tl.zeros([], dtype=tl.int64)
            for s in tl.static_range(R):
                ok = go & (tl.load(ctl + flags.off_ll_mask(R) + s, volatile=True) == 0)
                c = tl.where(ok, tl.load(area_w + hb + s * experts_per_rank + le), 0).to(tl.int64)
                inside = (j >= beg) & (j < beg + c)
                src = tl.where(inside, s, src)
                i = tl.where(inside, j - beg, i)
                beg += c
            rec = hb + cnt_w + ((le * R + src) * n_max + i) * REC
            tk = tl.load(area_w + rec + records.ll_rec_slot(PW, SW), mask=valid, other=-1)
            tl.store(src_info + le * RN + j, tk // K, mask=valid)
            tl.store(ret_slot + le * RN + j, (src * (n_max * K) + tk).to(tl.int32), mask=valid)
            # Payload and scales (as DeepEP, rows past the count are left as they are).
            for w0 in range(0, PW, BLOCK_W):
                ow = w0 + tl.arange(0, BLOCK_W)
                mw = valid[:, None] & (ow < PW)[None, :]
                tl.store(out_w + (le * RN + j)[:, None] * PW + ow[None, :],
                         tl.load(area_w + rec[:, None] + ow[None, :], mask=mw), mask=mw)
            if SW > 0:
                os_ = tl.arange(0, BLOCK_S)
                ms = valid[:, None] & (os_ < SW)[None, :]
                sb = tl.load(area_w + rec[:, None] + PW + os_[None, :], mask=ms, other=0)
                if UE8M0:       # 4 exponent bytes per int32, column-major [E_local, SW/4, RN]
                    ex = tl.reshape((sb >> 23) & 0xFF, [BLOCK_R, BLOCK_S // 4, 4])
                    sh = tl.arange(0, 4) * 8
                    packed = tl.sum(ex << sh[None, None, :], axis=2)
                    oq = tl.arange(0, BLOCK_S // 4)
                    tl.store(out_s + le * (SW // 4) * RN + oq[None, :] * RN + j[:, None], packed,
                             mask=valid[:, None] & (oq < SW // 4)[None, :])
                else:           # fp32 bits, column-major [E_local, SW, RN]
                    tl.store(out_s + le * SW * RN + os_[None, :] * RN + j[:, None], sb, mask=ms)
        # The handle's tables past the count: -1, blocks of BLOCK_F spread over the expert's programs.
        for j0 in range(total + b * BLOCK_F, RN, NB * BLOCK_F):
            j = j0 + tl.arange(0, BLOCK_F).to(tl.int64)
            mf = j < RN
            tl.store(src_info + le * RN + j, tl.full([BLOCK_F], -1, tl.int32), mask=mf)
            tl.store(ret_slot + le * RN + j, tl.full([BLOCK_F], -1, tl.int32), mask=mf)


@triton.jit
def wait_recv(ctl, hdr, hdr_delta, host, n, sig, me, timeout_ns, cost_ptr, cost_on, stage, R: tl.constexpr,
              SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr, COST: tl.constexpr, ring_ctl=None,
              NET: tl.constexpr = False):
    """Before a receive of call ``n`` (dispatch or combine): wait for every peer's ``READY`` of the call's half
    and check its signature (wait ns per peer into ``cost_ptr`` with ``COST`` where ``cost_on``; with ``NET`` the
    waits end once the RDMA proxy of control block ``ring_ctl`` failed: :func:`ll_net.abort_word`). Returns True
    when the program may move data."""
    return ll_flags.ll_wait_peers(ctl, hdr, hdr_delta, host, flags.off_ll_ready(R) + (n & 1) * R, n, sig, me, stage,
                               timeout_ns, R=R, REMOTE=False, CHECK_SIG=True, SHRINK=SHRINK, USE_CLOCK=USE_CLOCK,
                               COST=COST, cost_ptr=cost_ptr, cost_on=cost_on, abort=ll_net.abort_word(ring_ctl, NET))


@triton.jit
def recv_call(ctl, hdr, hdr_delta, sig, me, offset, R: tl.constexpr, DEFER: tl.constexpr):
    """Start of a split receive launch (dispatch or combine): releases the last receive's ``CONS`` (a hook's receive
    may follow another receive) and returns the call it receives: with ``DEFER`` the one the send launch just
    before it sent and left to it to publish (it publishes it here), else the rank's last sent call less the sends
    issued after it (``offset``, host-known)."""
    ll_flags.ll_release_cons(ctl)
    if DEFER:
        n = ll_flags.ll_publish_deferred(ctl, hdr, hdr_delta, sig, R, me)
    else:
        n = tl.load(ctl + flags.L_SEQ) - offset
    return n


@names.jit('low_latency', 'dispatch', do_not_specialize=['offset', 'sig', 'me', 'timeout_ns'])
def _ll_dispatch_recv_kernel(area_w, ctl, out_w, out_s, src_info, ret_slot, layout, count, stats_ptr, cost_ptr,
                             offset, n_max, ctl_w, half_w, cnt_w, experts_per_rank,
                             hdr, hdr_delta, host, sig, me, timeout_ns, ring_ctl, NET: tl.constexpr,
                             R: tl.constexpr, K: tl.constexpr, PW: tl.constexpr, SW: tl.constexpr,
                             REC: tl.constexpr, UE8M0: tl.constexpr, STATS: tl.constexpr, COST: tl.constexpr,
                             SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                             DEFER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr):
    pdl.pdl_start()
    area_w = area_w.to(tl.pointer_type(tl.int32), bitcast=True)
    # (the rows and their scales as words, whatever their dtypes)
    out_w = out_w.to(tl.pointer_type(tl.int32), bitcast=True)
    out_s = out_s.to(tl.pointer_type(tl.int32), bitcast=True)
    p = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    n = recv_call(ctl, hdr, hdr_delta, sig, me, offset, R, DEFER)
    half = n & 1
    go = wait_recv(ctl, hdr, hdr_delta, host, n, sig, me, timeout_ns, cost_ptr, p == 0, flags.STAGE_LL_DISPATCH_RECV,
                   R, SHRINK, USE_CLOCK, COST, ring_ctl, NET)
    # Program (p, q) takes local experts p, p + P0, ... (P0 capped where ranks share a GPU), of each the row
    # blocks q, q + P1, ...
    recv_part(area_w, ctl, out_w, out_s, src_info, ret_slot, layout, count, stats_ptr, n_max, ctl_w + half * half_w,
              cnt_w, experts_per_rank, go, tl.program_id(0), tl.num_programs(0), tl.program_id(1), tl.num_programs(1),
              R, K, PW, SW, REC, UE8M0, STATS, BLOCK_R, BLOCK_W, BLOCK_S, BLOCK_F)
    # Program (0, 0) records the call; the rank's next low-latency launch frees the half for call n + 2.
    ll_flags.ll_finish_recv(ctl, half, n)


_ll_dispatch_recv_launch = Launcher(_ll_dispatch_recv_kernel, **pdl.options())


def ll_route(topk_idx: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, ctl: torch.Tensor,
             num_experts: int, num_ranks: int, signals: dict) -> None:
    """Slots of this rank's (token, expert) rows: ``slots`` int32 ``[T, K]`` (``-1``: no row), ``counts``
    int32 ``[E]`` (rows per expert). ``topk_idx`` int32/int64 ``[T, K]``; ``ctl``: int64 control block."""
    T, K = topk_idx.shape
    tune = tuning("ll_route")
    key = (K, num_experts, num_ranks, tuple(tune.items()))
    launch = bound(_ROUTE_BOUND, key, lambda: _bind_route(K, num_experts, num_ranks, tune))
    launch(topk_idx, slots, counts, ctl, T, num_experts, num_experts // num_ranks, signals["hdr"], signals["hdr_delta"],
           signals["host"], signals["me"])


_ROUTE_BOUND: dict = {}


def _bind_route(K, num_experts, num_ranks, tune):
    # (tokens per block: BLOCK_T * BLOCK_K entries a tile)
    bt = max(1, tune["block_t"] * 8 // pow2(K, 8))
    be = pow2(tune["experts"])
    return _ll_route_launch.bind((cdiv(num_experts, be),), num_warps=tune["num_warps"], R=num_ranks, K=K,
                                 BLOCK_T=pow2(bt), BLOCK_K=pow2(K), BLOCK_E=be)


def ll_dispatch_send(x: torch.Tensor, topk_idx: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                     area: torch.Tensor, delta_words: torch.Tensor, ctl: torch.Tensor, lay, sig: int,
                     use_fp8: bool, round_scale: bool, shrink: bool, signals: dict, native_fp8: bool, net=None,
                     defer: bool = False) -> None:
    """Write this rank's rows into the experts' ranks (bf16, or cast to FP8 on the way).

    ``x`` bf16 ``[T, H]``; ``topk_idx`` ``[T, K]``; ``slots``/``counts`` from :func:`ll_route`; ``area``:
    int32 view of the local low-latency area (peers at ``+ delta_words[r]``); ``ctl``: its int64 control
    block; ``lay``: the call's layout (:class:`triton_ep.protocol.ll_area.Layout`); ``sig``: call signature;
    ``net``: the network leg (every other rank gets a chunk in the send ring, :mod:`.ll_net`), or None;
    ``defer``: no end-of-launch count, the call's :func:`ll_dispatch_recv` (with ``defer``) comes next in the
    stream and publishes it (a call without a receive hook; not with ``net``)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    tune = tuning("ll_send")
    key = (T, H, K, lay, use_fp8, round_scale, native_fp8, shrink, net is not None, signals["use_clock"],
           signals.get("max_programs"), bool(defer), tuple(tune.items()))
    launch = bound(_SEND_BOUND, key, lambda: _bind_send(*key[:-1], signals, tune))
    launch(x, x, topk_idx, slots, counts, area, area, area, delta_words, ctl,     # (typed by the kernel)
           T, lay.num_experts, lay.experts_per_rank, lay.n_max, lay.ctl_words, lay.half_words, lay.count_words,
           signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"], signals["timeout_ns"],
           *ll_net.kernel_args(net, ctl))


_SEND_BOUND: dict = {}


def _bind_send(T, H, K, lay, use_fp8, round_scale, native_fp8, shrink, has_net, use_clock, _cap, defer, signals, tune):
    if defer and has_net:
        raise ValueError("a deferred low-latency send (no receive hook) is for calls within one host")
    bt = tune["block_t"]
    bh = 1 << (min(H, tune["block_h"]).bit_length() - 1)   # a power of two (a block) dividing H
    while H % bh:
        bh //= 2
    return _ll_dispatch_send_launch.bind(
        grid2(cdiv(T, bt), H // bh, signals), num_warps=tune["num_warps"], NET=has_net, CW=lay.net_count_words,
        BLOCK_C=pow2(lay.experts_per_rank), R=lay.num_ranks, K=K, H=H, PW=records.ll_payload_words.host(H, use_fp8),
        SW=records.ll_scale_words.host(H, use_fp8), REC=lay.record_words(use_fp8), FP8=use_fp8, ROUND_SCALE=round_scale,
        NATIVE=native_fp8, SHRINK=shrink, USE_CLOCK=use_clock, USE_ASM=use_clock, DEFER=defer,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_K=pow2(K), BLOCK_E=1024)


def ll_dispatch_recv(area: torch.Tensor, ctl: torch.Tensor, lay, offset: int, num_topk: int, use_fp8: bool,
                     use_ue8m0: bool, out_words: torch.Tensor, out_scales: Optional[torch.Tensor],
                     src_info: torch.Tensor, ret_slot: torch.Tensor, layout_range: torch.Tensor, count: torch.Tensor,
                     stats: Optional[torch.Tensor], cost: Optional[torch.Tensor], sig: int, shrink: bool,
                     signals: dict, defer: bool = False, net=None) -> None:
    """Pack the rows this rank received (call ``SEQ - offset``) expert-major into ``out_words`` (``[E_local,
    R*N, H]`` FP8 or bf16, or its int32 view ``[E_local, R*N, PW]``: written as words) and ``out_scales`` (fp32
    or int32, column-major: written as bits), and fill ``src_info``
    int32 / ``ret_slot`` int32 ``[E_local, R*N]``, ``layout_range`` int64 ``[E_local, R]``, ``count`` int32
    ``[E_local]``; adds the counts to ``stats`` (int32 ``[E_local]``) and wait ns to ``cost`` (int64). With
    ``defer`` the call is the one the send launch just before it sent with ``defer`` (``offset`` is not used):
    this launch publishes it first (:func:`triton_ep.kernels.ll_flags.ll_publish_deferred`). ``net``: the network leg
    (its waits end once the RDMA proxy failed), or None."""
    El, RN, PW = out_words.shape[0], out_words.shape[1], row_words(out_words)
    tune = tuning("ll_recv")
    key = (El, RN, PW, lay, num_topk, use_fp8, use_ue8m0, stats is not None, cost is not None, shrink,
           signals["use_clock"], signals.get("max_programs"), bool(defer), net is not None, tuple(tune.items()))
    launch = bound(_RECV_BOUND, key, lambda: _bind_recv(*key[:-1], signals, tune))
    launch(area, ctl, out_words, out_scales if out_scales is not None else out_words, src_info, ret_slot, layout_range,
           count, stats if stats is not None else count, cost if cost is not None else layout_range,
           offset, lay.n_max, lay.ctl_words, lay.half_words, lay.count_words, lay.experts_per_rank,
           signals["hdr"], signals["hdr_delta"], signals["host"], sig, signals["me"], signals["timeout_ns"],
           ll_net.ring_arg(net, ctl))


_RECV_BOUND: dict = {}


def _bind_recv(El, RN, PW, lay, num_topk, use_fp8, use_ue8m0, has_stats, has_cost, shrink, use_clock, _cap, defer,
               has_net, signals, tune):
    SW = records.ll_scale_words.host(lay.hidden, use_fp8)
    return _ll_dispatch_recv_launch.bind(
        grid2(min(El, tune["expert_programs"] or El), tune["programs_per_expert"], signals), num_warps=tune["num_warps"],
        R=lay.num_ranks, K=num_topk, PW=PW, SW=SW, REC=lay.record_words(use_fp8), UE8M0=use_ue8m0,
        STATS=has_stats, COST=has_cost, SHRINK=shrink, USE_CLOCK=use_clock,
        USE_ASM=use_clock, DEFER=defer, NET=has_net, BLOCK_R=tune["block_r"],
        BLOCK_W=pow2(min(PW, tune["block_w"])),
        BLOCK_S=pow2(max(SW, 4)), BLOCK_F=min(pow2(RN), tune["block_f"]))
