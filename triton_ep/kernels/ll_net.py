"""Low-latency mode's network leg: the chunks a low-latency call sends the ranks of other hosts through the
RDMA scheduler's rings (:mod:`triton_ep.scheduler`), and the launch that unpacks the chunks received.

Each call sends every rank on the network one chunk, in the scheduler's ring of 2 slots per peer (the two
halves of the area): call ``n``'s chunk to rank ``p`` is chunk ``k = n - 1 + TXOFF[p]`` of that ring, in slot
``k & 1``, and from ``p`` chunk ``n - 1 + RXOFF[p]`` (the offsets are 0 until a re-synchronisation, after an
error or to unmask ranks, restarts the call numbers; :mod:`triton_ep.modes.internode.low_latency`). A chunk is
(:data:`triton_ep.protocol.records.NET_HEADER_WORDS` header words, int64 ``[n, signature, status, rows]``):

- dispatch: the counts (int32 ``[E/R]``, padded to 4) of the receiver's local experts, then the records
  (as in the area, :mod:`.ll_dispatch`), packed by expert: the rows for the receiver's expert ``e`` follow
  those for its experts below ``e``, each expert's in slot order;
- combine: the rows returned to the source, each ``[t * K + k, 3 pad words, bf16 row]`` (with ``use_logfmt``
  the row's LogFMT-10 record instead, :mod:`.logfmt`), in the order of
  the records the source sent (so the packing needs no search).

The send launches (:mod:`.ll_dispatch`, :mod:`.ll_combine`) write the chunk straight into the send slot
(after waiting until the slot's earlier chunk was placed at the peer: ``SENT >= k - 1``); their last
program writes each chunk's header and length and releases ``READY = k + 1`` at system scope, and the proxy
posts the chunk's WRITEs and then its signal on one queue pair (the count travels after the rows, in-QP
ordering). :func:`ll_unpack` (the first launch of the receive, or of the hook) waits for each network peer's
chunk (``TAIL`` past it, or with arrival words the chunk's arrival word, which the sender's proxy writes after
the chunk on its QP: ``Scheduler(arrival_words=True)``), copies its records or rows into this rank's half as a peer on the same host would
have written them, then releases ``READY[s] = n`` in this rank's control block: the receive launches that
follow are the same as within one host. A chunk whose status says the sender failed the call ends the
receive's wait for that rank with ``EPRemoteError``; a chunk of another call number, or of another call
signature (the sender passed other sizes or options: its chunk's layout is not this rank's), with a mismatch,
and nothing of it is copied.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import names
from . import flags, ll_flags
from ._util import pow2
from .geometry import grid2
from .launch import Launcher
from ..protocol.records import NET_HEADER_WORDS

#: header words of a chunk (int32 words; int64 ``[n, signature, status, rows]``)
NH: tl.constexpr = tl.constexpr(NET_HEADER_WORDS)
#: ring slots per peer: one per half of the area
S: tl.constexpr = tl.constexpr(2)


def kernel_args(net, ctl: torch.Tensor) -> tuple:
    """The send launches' ``(ring_ctl, ring_dw, slot_w, remote)``: the network leg's (``net``), or
    placeholders."""
    return (ctl, 0, 0, ctl) if net is None else (net.ring_ctl, net.send_dw, net.slot_w, net.remote)


def ring_arg(net, ctl: torch.Tensor) -> torch.Tensor:
    """The receive launches' ``ring_ctl`` (whose abort word their waits read, :func:`abort_word`): the network
    leg's (``net``), or a placeholder."""
    return ctl if net is None else net.ring_ctl


@triton.jit
def tx_chunk(ctl, r, n, R: tl.constexpr):
    """The ring's chunk number of call ``n``'s chunk to rank ``r`` (elementwise over tensors ``r``)."""
    return n - 1 + tl.load(ctl + flags.off_ll_tx(R) + r)


@triton.jit
def rx_chunk(ctl, r, n, R: tl.constexpr):
    """The ring's chunk number of call ``n``'s chunk from rank ``r``."""
    return n - 1 + tl.load(ctl + flags.off_ll_rx(R) + r)


@triton.jit
def chunk_at(ring_dw, peer, k, slot_w):
    """Word (relative to the area) where chunk ``k`` for / from ``peer`` starts, in the ring at ``ring_dw``."""
    return ring_dw + (peer * S + (k & 1)) * slot_w


@triton.jit
def rows_before(cnt_ptr, first, upto, num, BLOCK_C: tl.constexpr):
    """``sum(cnt_ptr[first + c] for c < upto)``, elementwise over the (2-D) tensors ``first`` and ``upto``;
    ``num`` bounds ``c``."""
    acc = tl.zeros_like(upto)
    oc = tl.arange(0, BLOCK_C)
    for c0 in range(0, num, BLOCK_C):
        c = c0 + oc[None, None, :]
        v = tl.load(cnt_ptr + first[:, :, None] + c, mask=c < upto[:, :, None], other=0)
        acc += tl.sum(v, axis=2).to(acc.dtype)
    return acc


@triton.jit
def abort_word(ring_ctl, NET: tl.constexpr):
    """With ``NET`` (a call with network peers), the RDMA proxy's abort word (``RING_ABORT`` of its control block
    ``ring_ctl``: nonzero once the proxy failed, :meth:`triton_ep.scheduler.Scheduler.fail`), which every wait of the
    call reads (:func:`flags.wait_at_least`); else ``None`` (nothing more to read)."""
    if NET:
        word = ring_ctl + flags.RING_ABORT
    else:
        word = None
    return word


@triton.jit
def mask_peer(ctl, ring_ctl, r, n, R: tl.constexpr):
    """Rank masking (``enable_shrink``): this rank gives up on rank ``r`` in its low-latency call ``n`` (``r`` stopped
    answering, is gone, or gave up on this rank); this rank no longer sends to it or waits for it (``MASK[r]``), and
    its proxy drops what it still holds for it (``MASKED[r]``) and tells it (``GSRC[r] = n``, stored first, unless
    set: the proxy writes it into ``r``'s ``GAVE[me]``, so that ``r`` never takes this rank's chunk of call ``n`` or
    a later call's as its own calls' data)."""
    tl.store(ctl + flags.off_ll_mask(R) + r, tl.full([], 0, tl.int64) + flags.LL_MASK_WAIT)
    gsrc = ring_ctl + flags.ring_gsrc_word(R, S, r)
    if tl.load(gsrc, volatile=True) == 0:
        tl.store(gsrc, tl.full([], 0, tl.int64) + n)
    flags.release(ring_ctl + flags.ring_masked_word(R, S, r), tl.full([], 1, tl.int64))


@triton.jit
def gave_word(ring_ctl, r, R: tl.constexpr, SHRINK: tl.constexpr):
    """With ``SHRINK``, rank ``r``'s ``GAVE`` word in this rank's ring control block (the call in which ``r`` gave up
    on this rank: a wait of a call from then on ends at once, :func:`flags.wait_at_least`'s ``gave_ptr``); else
    ``None`` (nothing more to read)."""
    if SHRINK:
        word = ring_ctl + flags.ring_gave_word(R, S, r)
    else:
        word = None
    return word


@triton.jit
def live_peer(ctl, remote, r, R: tl.constexpr):
    """Whether rank ``r`` is on the network and not masked."""
    return (tl.load(remote + r) != 0) & (tl.load(ctl + flags.off_ll_mask(R) + r, volatile=True) == 0)


@triton.jit
def wait_slots(ring_ctl, remote, hdr, hdr_delta, host, n, me, stage, timeout_ns, R: tl.constexpr,
               USE_CLOCK: tl.constexpr, ctl, SHRINK: tl.constexpr):
    """A send launch of call ``n`` waits until every network peer's send slot for its chunk ``k`` is free
    (chunk ``k - 2`` placed there: ``SENT >= k - 1``); masked peers are not waited for, and with ``SHRINK`` a
    peer that times out is masked. The waits end once the proxy failed (its abort word). Returns True when the
    program may write."""
    bad = (tl.load(hdr + flags.W_ERR, volatile=True) != 0).to(tl.int32)
    for r in tl.static_range(R):
        if (bad == 0) & live_peer(ctl, remote, r, R):
            st = flags.wait_at_least(ring_ctl + flags.ring_word(flags.RING_SENT, R, r), tx_chunk(ctl, r, n, R) - 1,
                                     hdr, host, r, 0, timeout_ns, R, USE_CLOCK, fail_call=n,
                                     abort=ring_ctl + flags.RING_ABORT, gave_ptr=gave_word(ring_ctl, r, R, SHRINK))
            if SHRINK & ((st == flags.E_TIMEOUT) | (st == flags.E_GONE)):
                mask_peer(ctl, ring_ctl, r, n, R)
                st = tl.full([], 0, tl.int32)
            if st != 0:
                flags.post_wait_error(hdr, hdr_delta, host, st, r, stage, tl.load(hdr + flags.W_BASE) + 1, me, R,
                                      ctl, n)
            bad = bad + st
    return bad == 0


@triton.jit
def publish(area_w, ring_ctl, ring_dw, slot_w, r, n, k, sig, ok, rows, ROW_W, EXTRA_W, R: tl.constexpr):
    """Call ``n``'s chunk ``k`` for peer ``r`` is written (``rows`` of ``ROW_W`` words after ``EXTRA_W``
    words): store its header (status ``E_FAILED`` and no rows when not ``ok``) and length, then release
    ``READY = k + 1``."""
    zero = tl.full([], 0, tl.int64)
    rows = tl.where(ok, rows.to(tl.int64), 0)
    h = (area_w + chunk_at(ring_dw, r, k, slot_w)).to(tl.pointer_type(tl.int64))
    tl.store(h, zero + n)
    tl.store(h + 1, zero + sig)
    tl.store(h + 2, tl.where(ok, zero, zero + flags.E_FAILED))
    tl.store(h + 3, rows)
    nbytes = 4 * (NH + tl.where(ok, EXTRA_W + rows * ROW_W, 0))
    tl.store(ring_ctl + flags.ring_len_word(R, S, r, k & 1), nbytes)
    flags.release(ring_ctl + flags.ring_word(flags.RING_READY, R, r), zero + k + 1)


@triton.jit
def finish_send(ctl, hdr, hdr_delta, area_w, ring_ctl, ring_dw, slot_w, remote, half, n, sig, me, rows_ptr, stride,
                col, experts_per_rank, ROW_W, EXTRA_W, R: tl.constexpr, BLOCK_C: tl.constexpr, USE_ASM: tl.constexpr):
    """End of a send launch with network peers: the last program publishes each network peer ``r``'s chunk
    (its rows: ``sum(rows_ptr[c * stride + r * col] & 0xFFFFFFFF for c < experts_per_rank)``, the counts of
    its experts or of the rows received from it), releases ``READY = n`` (signature first) in each peer on
    this host as :func:`ll_flags.ll_finish_send` does (unless this rank holds an error), and records ``n`` as
    this rank's last call."""
    if flags.last_program_at(ctl + flags.L_DONE, USE_ASM):
        ok = tl.load(hdr + flags.W_ERR, volatile=True) == 0
        oc = tl.arange(0, BLOCK_C)
        for r in tl.static_range(R):
            if live_peer(ctl, remote, r, R):
                v = tl.load(rows_ptr + oc * stride + r * col, mask=oc < experts_per_rank, other=0).to(tl.int64)
                publish(area_w, ring_ctl, ring_dw, slot_w, r, n, tx_chunk(ctl, r, n, R), sig, ok,
                        tl.sum(v & 0xFFFFFFFF), ROW_W, EXTRA_W, R)
            elif ok & (r != me):
                peer = ctl + tl.load(hdr_delta + r)
                tl.store(peer + flags.off_ll_sig(R) + half * R + me, ll_flags.publish_sig(ctl, r, sig, R))
                flags.release(peer + flags.off_ll_ready(R) + half * R + me, n)
        tl.store(ctl + flags.L_SEQ, n)


@names.jit('low_latency', 'unpack', do_not_specialize=['offset', 'me', 'timeout_ns', 'ring_dw', 'sig'])
def _ll_unpack_kernel(area_w, ctl, ring_ctl, ring_dw, slot_w, remote, offset, sig, n_max, ctl_w, half_w, cnt_w,
                      experts_per_rank, hdr, hdr_delta, host, me, timeout_ns, cost_ptr, R: tl.constexpr,
                      COMBINE: tl.constexpr, REC: tl.constexpr, COST: tl.constexpr,
                      CW: tl.constexpr, RW: tl.constexpr, SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr,
                      USE_ASM: tl.constexpr, ARRIVAL_WORD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    ll_flags.ll_release_cons(ctl)      # (a hook's receive may follow another receive)
    # Program (s, q): the chunk from rank s (none from this rank or a masked one), work spread over q.
    n = tl.load(ctl + flags.L_SEQ) - offset
    half = n & 1
    s = tl.program_id(0)
    q = tl.program_id(1)
    P = tl.num_programs(1)
    stage = flags.STAGE_LL_DISPATCH_RECV + COMBINE * (flags.STAGE_LL_COMBINE_RECV - flags.STAGE_LL_DISPATCH_RECV)
    hb = ctl_w + half * half_w
    live = live_peer(ctl, remote, s, R) & (tl.load(hdr + flags.W_ERR, volatile=True) == 0)
    if live:
        k = rx_chunk(ctl, s, n, R)
        t0 = flags.now_ns(USE_CLOCK)
        if ARRIVAL_WORD:    # the sender's arrival word for this slot, written after the chunk on its QP
            arrived = ring_ctl + flags.ring_arrive_word(R, S, s, k & 1)
        else:               # the tail the receiving proxy moves on the chunk's receive completion
            arrived = ring_ctl + flags.ring_word(flags.RING_TAIL, R, s)
        st = flags.wait_at_least(arrived, k + 1, hdr, host, s, 0, timeout_ns, R, USE_CLOCK, fail_call=n,
                                 abort=ring_ctl + flags.RING_ABORT, gave_ptr=gave_word(ring_ctl, s, R, SHRINK))
        if COST:            # the wait for s's chunk is the receive's wait for s (its wait-cost statistics)
            if q == 0:
                tl.atomic_add(cost_ptr + s, flags.now_ns(USE_CLOCK) - t0, sem="relaxed")
        if SHRINK & ((st == flags.E_TIMEOUT) | (st == flags.E_GONE)):
            mask_peer(ctl, ring_ctl, s, n, R)   # its rows are dropped: the receive does not wait for it
        elif st != 0:
            flags.post_wait_error(hdr, hdr_delta, host, st, s, stage, tl.load(hdr + flags.W_BASE) + 1, me, R, ctl, n)
        else:
            base = chunk_at(ring_dw, s, k, slot_w)
            h = (area_w + base).to(tl.pointer_type(tl.int64))
            # (a chunk of another signature is laid out for other sizes: reading it as this call's could run
            # past the slot, and its counts past this rank's half)
            good = (tl.load(h + 2) == 0) & (tl.load(h) == n) & (tl.load(h + 1) == sig)
            if good:
                if COMBINE:
                    rows = tl.load(h + 3)
                    ow = tl.arange(0, BLOCK_W)
                    for p0 in range(q * BLOCK_R, rows, P * BLOCK_R):
                        p = p0 + tl.arange(0, BLOCK_R).to(tl.int64)
                        mp = p < rows
                        src = base + NH + p * RW
                        tk = tl.load(area_w + src, mask=mp, other=0).to(tl.int64)
                        dst = hb + cnt_w + tk * (RW - 4)
                        for w0 in range(0, RW - 4, BLOCK_W):
                            mw = mp[:, None] & ((w0 + ow) < RW - 4)[None, :]
                            tl.store(area_w + dst[:, None] + w0 + ow[None, :],
                                     tl.load(area_w + src[:, None] + 4 + w0 + ow[None, :], mask=mw), mask=mw)
                else:
                    oc = tl.arange(0, BLOCK_C)
                    cnt = base + NH
                    if q == 0:      # the counts, where a peer on this host would have written them
                        c = tl.load(area_w + cnt + oc, mask=oc < experts_per_rank)
                        tl.store(area_w + hb + s * experts_per_rank + oc, c, mask=oc < experts_per_rank)
                    ow = tl.arange(0, BLOCK_W)
                    for le in range(q, experts_per_rank, P):
                        pre = tl.sum(tl.load(area_w + cnt + oc, mask=oc < le, other=0)).to(tl.int64)
                        c = tl.load(area_w + cnt + le).to(tl.int64)
                        for i0 in range(0, c, BLOCK_R):
                            i = i0 + tl.arange(0, BLOCK_R).to(tl.int64)
                            mi = i < c
                            src = base + NH + CW + (pre + i) * REC
                            dst = hb + cnt_w + ((le * R + s) * n_max + i) * REC
                            for w0 in range(0, REC, BLOCK_W):
                                mw = mi[:, None] & ((w0 + ow) < REC)[None, :]
                                tl.store(area_w + dst[:, None] + w0 + ow[None, :],
                                         tl.load(area_w + src[:, None] + w0 + ow[None, :], mask=mw), mask=mw)
            else:
                if q == 0:      # the receive's wait for s ends at once: s failed this call, or made another
                    kind = tl.where((tl.load(h) == n) & (tl.load(h + 2) != 0), flags.E_FAILED, flags.E_MISMATCH)
                    tl.store(ctl + flags.off_ll_failed(R) + s, flags.ll_failure_word(n, kind, s))
    # The last program: READY = n for each chunk unpacked whole (its signature first), and the ring slots back
    # to the proxy in call order (hooks may run out of order: HEAD moves past call n only once n - 1 is done).
    if flags.last_program_at(ctl + flags.L_DONE, USE_ASM):
        if tl.load(hdr + flags.W_ERR, volatile=True) == 0:
            for r in tl.static_range(R):
                if live_peer(ctl, remote, r, R):
                    h = (area_w + chunk_at(ring_dw, r, rx_chunk(ctl, r, n, R), slot_w)).to(tl.pointer_type(tl.int64))
                    if (tl.load(h + 2) == 0) & (tl.load(h) == n) & (tl.load(h + 1) == sig):
                        tl.store(ctl + flags.off_ll_sig(R) + half * R + r, tl.load(h + 1))
                        flags.release(ctl + flags.off_ll_ready(R) + half * R + r, n)
        tl.store(ctl + flags.L_UNPACKED + half, n)
        other = tl.load(ctl + flags.L_UNPACKED + (1 - half))
        head = tl.where(other == n + 1, n + 1, tl.where(other == n - 1, n, 0))
        if head > 0:
            for r in tl.static_range(R):
                if tl.load(remote + r) != 0:
                    flags.release(ring_ctl + flags.ring_word(flags.RING_HEAD, R, r), rx_chunk(ctl, r, head, R) + 1)


_ll_unpack_launch = Launcher(_ll_unpack_kernel)


def ll_unpack(area: torch.Tensor, ctl: torch.Tensor, net, lay, offset: int, combine: bool, use_fp8: bool,
              shrink: bool, signals: dict, cost: Optional[torch.Tensor] = None, use_logfmt: bool = False,
              sig: int = 0) -> None:
    """Unpack the chunks of call ``SEQ - offset`` from every rank on the network into this rank's half
    (``combine``: returned rows at their slots ``t * K + k``; else the dispatch's counts and records). ``sig``: this
    rank's signature of the call (:func:`~triton_ep.transport.signals.call_signature`): a chunk of another
    signature is not copied, and the receive's wait for its sender ends with a mismatch (``ValueError``).

    ``area``: int32 view of the local low-latency area; ``ctl``: its int64 control block; ``net``: the leg
    (``ring_ctl`` int64 control block of the scheduler's region, ``recv_dw``: its receive ring's first word
    relative to ``area``, ``slot_w``: words per slot); ``lay``: the call's
    :class:`~triton_ep.protocol.ll_area.Layout`; ``net.arrival_words``: wait for each chunk's arrival word instead of
    the tail; ``shrink``: a peer that times out is masked; ``cost``: int64
    ``[R]``, the call's wait-cost statistics: the nanoseconds spent waiting for each network peer's chunk are
    added to its entry (0 under the interpreter, which has no clock), as the receive adds its own waits;
    ``use_logfmt``: a combine's rows are LogFMT-10 records (``lay.net_logfmt_row_words`` a row)."""
    R = lay.num_ranks
    rw = lay.net_logfmt_row_words if use_logfmt else lay.net_row_words
    rec = lay.record_words(use_fp8)
    _ll_unpack_launch[grid2(R, 4, signals)](
        area, ctl, net.ring_ctl, net.recv_dw, net.slot_w, net.remote, offset, sig, lay.n_max, lay.ctl_words, lay.half_words,
        lay.count_words, lay.experts_per_rank, signals["hdr"], signals["hdr_delta"], signals["host"], signals["me"],
        signals["timeout_ns"], cost if cost is not None else ctl, R=R, COMBINE=combine, REC=rec,
        COST=cost is not None, CW=lay.net_count_words, RW=rw, SHRINK=shrink,
        USE_CLOCK=signals["use_clock"], USE_ASM=signals["use_clock"], ARRIVAL_WORD=net.arrival_words, BLOCK_R=4,
        BLOCK_W=pow2(min(rw - 4 if combine else rec, 1024)), BLOCK_C=pow2(lay.experts_per_rank), num_warps=4)
