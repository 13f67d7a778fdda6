"""Notify: the counts of every non-cached dispatch, exchanged on the device.

Each rank's send counts per destination (one row of the ``R x R`` matrix ``C[s][j]``) are written into
every rank's signal header (``NOTIFY``), then released with ``NOTIFIED[me] = n`` (``n``: the call's first
round). Every rank then waits for all rows and builds the handle's device tables from the matrix in the
same launch.

- :func:`notify_send` (one program): bad ids in this rank's ``topk_idx`` end the call here (an error
  record, and the peers are told); else it publishes this rank's row and, for a plain dispatch, its
  per-expert counts of each rank's experts (``NOTIFY_E``), or, with ``num_worst_tokens``, its own value
  (``NOTIFY_E[me]``: ranks may pass different values).
- :func:`notify_recv` (one program): waits for every row, writes the handle's tables from the matrix, and
  checks that no rank receives more rows than its ``num_worst_tokens`` (the same check on every rank, from
  the same matrix and values). A peer that released data of the awaited round before notifying runs
  another collective: ``E_MISMATCH``.

With ``num_worst_tokens`` the whole dispatch only enqueues work (it captures in a CUDA graph). A plain
dispatch's host must learn how many rows arrive: ``notify_recv`` also writes them, the group's row
maxima and the rows per local expert into a host-visible block and releases a sequence word there last,
which the host polls (the call's one host wait; no stream synchronise, no host barrier).

A rank's ``NOTIFY`` words are rewritten only by a later call's notify, by which time every rank has read
them: each rank reads them before its first send of the call, and the writer's previous call could not
finish before that send released its rows.
"""
import torch
import triton
import triton.language as tl

from . import names
from . import flags
from ..protocol import records
from .launch import Launcher
from ._util import pow2
from .geometry import sync_args, use_clock

# The host result block of a plain dispatch's notify (int64 words; pinned host memory on GPU).
RES_SEQ = tl.constexpr(0)          #: the dispatch number, released last: the host polls it
RES_STATUS = tl.constexpr(1)       #: nonzero when an error record stopped the notify (the host raises it)
RES_N_RECV = tl.constexpr(2)       #: rows this rank receives
RES_RECV_MAX = tl.constexpr(3)     #: the most rows any rank receives
RES_SEND_MAX = tl.constexpr(4)     #: the most rows any rank sends
RES_EXPERTS = tl.constexpr(8)      #: then rows per local expert (E_local words)


@triton.jit
def _publish(counts_ptr, num_experts, experts_per_rank, num_worst, hdr, hdr_delta, host, me, R: tl.constexpr,
             EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr):
    """The send part: check this rank's counts, publish its row (and per-expert counts, or its
    num_worst_tokens) into every rank's header, then ``NOTIFIED[me] = n`` there."""
    # Step 1: this call's first round, and whether this rank's input is sound (no error yet, no bad id,
    # with EXPERTS no negative per-expert count: those were given by the caller).
    n = tl.load(hdr + flags.W_BASE) + 1
    ok = tl.load(hdr + flags.W_ERR, volatile=True) == 0
    nbad = tl.load(counts_ptr + R + num_experts).to(tl.int64)
    if ok & (nbad > 0):
        tl.store(host + flags.H_INFO, nbad)
        tl.store(host + flags.H_INFO2, tl.full([], 0, tl.int64) + num_experts)
        flags.post_error(hdr, hdr_delta, host, flags.E_BADIDS, me, flags.STAGE_NOTIFY, n, me, R)
        ok = ok & (nbad == 0)
    if EXPERTS:
        neg = tl.zeros([BLOCK_E], dtype=tl.int32)
        for e0 in range(0, num_experts, BLOCK_E):
            oe = e0 + tl.arange(0, BLOCK_E)
            neg += (tl.load(counts_ptr + R + oe, mask=oe < num_experts, other=0) < 0).to(tl.int32)
        if ok & (tl.sum(neg, axis=0) > 0):
            flags.post_error(hdr, hdr_delta, host, flags.E_BADCOUNTS, me, flags.STAGE_NOTIFY, n, me, R)
            ok = False
    # Step 2: this rank's row of the count matrix (and its per-expert counts for each rank's experts) into
    # every rank's header, then NOTIFIED[me] = n there.
    if ok:
        for r in tl.static_range(R):
            peer = hdr + tl.load(hdr_delta + r)
            for j in tl.static_range(R):
                tl.store(peer + flags.off_notify(R) + me * R + j, tl.load(counts_ptr + j).to(tl.int64))
            if EXPERTS:
                for e0 in range(0, experts_per_rank, BLOCK_E):
                    oe = e0 + tl.arange(0, BLOCK_E)
                    me_ = oe < experts_per_rank
                    c = tl.load(counts_ptr + R + r * experts_per_rank + oe, mask=me_, other=0).to(tl.int64)
                    tl.store(peer + flags.off_notify_e(R) + me * experts_per_rank + oe, c, mask=me_)
            else:       # num_worst_tokens: this rank's value, the bound on the rows it receives
                tl.store(peer + flags.off_notify_e(R) + me, tl.full([], 0, tl.int64) + num_worst)
            flags.release(peer + flags.off_nflag(R) + me, n)


@names.jit('intranode', 'notify', do_not_specialize=['num_worst', 'k', 'sig', 'me', 'timeout_ns'])
def _notify_send_kernel(counts_ptr, num_experts, experts_per_rank, num_worst, hdr, hdr_delta, host, k, sig, me,
                        timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr, EXPERTS: tl.constexpr,
                        BLOCK_E: tl.constexpr):
    # (the last receive's CONSUMED first, where it had no end-of-launch count: a peer that runs another collective
    # then gets as far as releasing READY, which the receive part below reads as the mismatch it is)
    flags.release_consumed(hdr)
    _publish(counts_ptr, num_experts, experts_per_rank, num_worst, hdr, hdr_delta, host, me, R, EXPERTS, BLOCK_E)


_notify_send_launch = Launcher(_notify_send_kernel)


@triton.jit
def _tables(t32_ptr, t64_ptr, num_worst, res_ptr, seq, experts_per_rank, hdr, hdr_delta, host, me, timeout_ns,
            R: tl.constexpr, USE_CLOCK: tl.constexpr, HOST_OUT: tl.constexpr, BLOCK_E: tl.constexpr):
    """The receive part: wait for every rank's row, write the handle's tables, check the bounds, and for a
    plain dispatch fill the host's result block."""
    n = tl.load(hdr + flags.W_BASE) + 1
    bad = (tl.load(hdr + flags.W_ERR, volatile=True) != 0).to(tl.int32)
    # Wait for every rank's row (a rank that failed or left ends the wait at once).
    for r in tl.static_range(R):
        if (bad == 0) & (r != me):
            # (a peer that released READY for round n first runs another collective: E_MISMATCH)
            st = flags.wait_at_least(hdr + flags.off_nflag(R) + r, n, hdr, host, r, n, timeout_ns, R, USE_CLOCK,
                                     None, -1, hdr + flags.off_ready(R) + r)
            # a peer that published its row and then failed (it found a rank over capacity, as this rank
            # will from the same matrix) does not stop this rank: the capacity error is named below
            if (st == flags.E_FAILED) & (flags.acquire(hdr + flags.off_nflag(R) + r) >= n):
                st = tl.full([], 0, tl.int32)
            if st != 0:
                flags.post_wait_error(hdr, hdr_delta, host, st, r, flags.STAGE_NOTIFY, n, me, R)
            bad = bad + st
    # The handle's tables, from the matrix C[s][j] (all zeros after an error: nothing will move).
    #   t32: rank_prefix_matrix [R, R] (cumulative over s), then DeepEP's channel_prefix_matrix and
    #        recv_channel_prefix_matrix with one channel: C[me][j] (rows sent to j) [R], and 0 [R] (where
    #        the channel starts within each source's rows)
    #   t64: row_base [R] (rpm[me-1], or 0 on rank 0), combine's comb_base [R] (sum of C[i][r<me]),
    #        send_base [R] (exclusive cumulative C[me]), prefix [R] (rpm[i][me]), then n_recv [1]
    NOTIFY = hdr + flags.off_notify(R)
    over = tl.full([], -1, tl.int64)
    got = tl.full([], 0, tl.int64)
    limit = tl.full([], 0, tl.int64)
    mine = tl.full([], 0, tl.int64)
    for j in tl.static_range(R):
        col = tl.full([], 0, tl.int64)
        for s in tl.static_range(R):
            col += tl.where(bad == 0, tl.load(NOTIFY + s * R + j, volatile=True), 0)
            tl.store(t32_ptr + s * R + j, col.to(tl.int32))
            tl.store(t64_ptr + j, col, mask=me == s + 1)                     # row_base = rpm[me - 1]
            tl.store(t64_ptr + records.t64_prefix(R) + s, col, mask=me == j)       # prefix = rpm[:, me]
        tl.store(t64_ptr + j, tl.zeros([], tl.int64), mask=me == 0)
        # rank j receives at most its num_worst_tokens (its notify sent it; a plain dispatch: no bound)
        if HOST_OUT:
            bound = tl.full([], 0, tl.int64) + num_worst
        else:
            bound = tl.load(hdr + flags.off_notify_e(R) + j, volatile=True)
        first = (over < 0) & (col > bound)
        got = tl.where(first, col, got)
        limit = tl.where(first, bound, limit)
        over = tl.where(first, j, over)
        # this rank's own row: sent to j, and before j
        c_me = tl.where(bad == 0, tl.load(NOTIFY + me * R + j, volatile=True), 0)
        tl.store(t64_ptr + records.t64_send_base(R) + j, mine)                     # send_base (exclusive)
        mine += c_me
        tl.store(t32_ptr + records.t32_channel(R) + j, c_me.to(tl.int32))         # channel_prefix_matrix[j][0]
        tl.store(t32_ptr + records.t32_recv_channel(R) + j, tl.zeros([], tl.int32))  # recv_channel_prefix_matrix[j][0]
        tl.store(t64_ptr + records.t64_n_recv(R), col, mask=me == j)              # n_recv = rpm[R-1][me]
    for i in tl.static_range(R):                                             # comb_base[i] = sum C[i][r < me]
        cb = tl.full([], 0, tl.int64)
        for r in tl.static_range(R):
            cb += tl.where((bad == 0) & (r < me), tl.load(NOTIFY + i * R + r, volatile=True), 0)
        tl.store(t64_ptr + records.t64_comb_base(R) + i, cb)
    if (bad == 0) & (over >= 0):
        tl.store(host + flags.H_INFO, got)
        tl.store(host + flags.H_INFO2, limit)
        flags.post_error(hdr, hdr_delta, host, flags.E_CAPACITY, over, flags.STAGE_NOTIFY, n, me, R)
    # For the host (a plain dispatch's one wait): rows received, the group's largest receive and send
    # totals (they size the rounds, the same on every rank), the rows per local expert, then seq, released
    # last: the host polls it.
    if HOST_OUT:
        rmax = tl.full([], 0, tl.int64)
        smax = tl.full([], 0, tl.int64)
        for j in tl.static_range(R):
            col = tl.full([], 0, tl.int64)
            row = tl.full([], 0, tl.int64)
            for s in tl.static_range(R):
                col += tl.where(bad == 0, tl.load(NOTIFY + s * R + j, volatile=True), 0)
                row += tl.where(bad == 0, tl.load(NOTIFY + j * R + s, volatile=True), 0)
            rmax = tl.maximum(rmax, col)
            smax = tl.maximum(smax, row)
            if j == me:
                tl.store(res_ptr + RES_N_RECV, col)
        tl.store(res_ptr + RES_RECV_MAX, rmax)
        tl.store(res_ptr + RES_SEND_MAX, smax)
        NOTIFY_E = hdr + flags.off_notify_e(R)
        for e0 in range(0, experts_per_rank, BLOCK_E):
            oe = e0 + tl.arange(0, BLOCK_E)
            me_ = oe < experts_per_rank
            acc = tl.zeros([BLOCK_E], dtype=tl.int64)
            for s in tl.static_range(R):
                acc += tl.where(bad == 0, tl.load(NOTIFY_E + s * experts_per_rank + oe, mask=me_, other=0,
                                                  volatile=True), 0)
            tl.store(res_ptr + RES_EXPERTS + oe, acc, mask=me_)
        tl.store(res_ptr + RES_STATUS, bad.to(tl.int64))
        flags.fence_all_threads(USE_CLOCK)
        tl.debug_barrier()
        flags.release(res_ptr + RES_SEQ, seq)


@names.jit('intranode', 'notify', do_not_specialize=['num_worst', 'seq', 'k', 'sig', 'me', 'timeout_ns'])
def _notify_recv_kernel(t32_ptr, t64_ptr, num_worst, res_ptr, seq, experts_per_rank, hdr, hdr_delta, host, k, sig,
                        me, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr, HOST_OUT: tl.constexpr,
                        BLOCK_E: tl.constexpr):
    _tables(t32_ptr, t64_ptr, num_worst, res_ptr, seq, experts_per_rank, hdr, hdr_delta, host, me, timeout_ns, R,
            USE_CLOCK, HOST_OUT, BLOCK_E)


_notify_recv_launch = Launcher(_notify_recv_kernel)


@names.jit('intranode', 'notify', do_not_specialize=['num_worst', 'num_worst_rx', 'seq', 'me', 'timeout_ns'])
def _notify_kernel(counts_ptr, num_experts, experts_per_rank, num_worst, t32_ptr, t64_ptr, num_worst_rx, res_ptr, seq,
                   hdr, hdr_delta, host, me, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr,
                   EXPERTS: tl.constexpr, HOST_OUT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EX: tl.constexpr):
    # notify_send then notify_recv in one program (one launch: it waits only for other ranks' launches)
    flags.release_consumed(hdr)         # (as _notify_send_kernel)
    _publish(counts_ptr, num_experts, experts_per_rank, num_worst, hdr, hdr_delta, host, me, R, EXPERTS, BLOCK_E)
    tl.debug_barrier()          # the program's own row (written by any of its threads) is read below
    _tables(t32_ptr, t64_ptr, num_worst_rx, res_ptr, seq, experts_per_rank, hdr, hdr_delta, host, me, timeout_ns, R,
            USE_CLOCK, HOST_OUT, BLOCK_EX)


_notify_launch = Launcher(_notify_kernel)


def _check_experts(experts: bool, num_experts: int) -> None:
    """Per-expert counts travel in ``NOTIFY_E``: at most its words of them (``ValueError`` beyond)."""
    if experts and num_experts > int(flags.NOTIFY_E_WORDS):
        raise ValueError(f"num_experts {num_experts} exceeds {int(flags.NOTIFY_E_WORDS)}")


def notify_send(counts: torch.Tensor, num_experts: int, signals: dict, experts: bool = False,
                num_worst_tokens: int = 0) -> None:
    """Publish this rank's send counts (``counts`` int32 ``[R + E + 1]`` from ``routing_layout``: rows per
    rank, per expert, then the number of bad ids) in every rank's header; with ``experts`` also the
    per-expert counts of each rank's experts (a plain dispatch, whose host learns them), after checking
    that none is negative (``E_BADCOUNTS``); without, this rank's ``num_worst_tokens`` (the bound
    :func:`notify_recv` checks its received rows against, on every rank)."""
    R = signals["hdr_delta"].shape[0]
    _check_experts(experts, num_experts)
    _notify_send_launch[(1,)](counts, num_experts, num_experts // R, num_worst_tokens,
                              *sync_args(signals, 0, 0, counts), R=R,
                              USE_CLOCK=use_clock(signals), EXPERTS=experts,
                              BLOCK_E=min(pow2(num_experts // R if experts else 1), 1024), num_warps=1 if not experts else 4)


def notify_recv(t32: torch.Tensor, t64: torch.Tensor, num_worst_tokens: int, signals: dict,
                res: torch.Tensor = None, seq: int = 0, experts_per_rank: int = 0) -> None:
    """Wait for every rank's counts and write the handle's tables: ``t32`` int32 ``[R*R + 2R]``
    (``rank_prefix_matrix``, and ``channel_prefix_matrix``, ``recv_channel_prefix_matrix`` as DeepEP's with
    one channel: the rows sent to each rank, zeros) and ``t64`` int64 ``[4R + 1]`` (row base in each
    receiver, combine's comb_base, send_base and prefix, then the rows this rank receives). Without
    ``res`` (a dispatch with ``num_worst_tokens``) records ``E_CAPACITY`` if a rank receives more rows than
    the ``num_worst_tokens`` its notify published (every rank finds the same rank); ``num_worst_tokens``
    is then unused. With ``res`` (int64 ``[8 + experts_per_rank]``, host-visible)
    also writes the rows received, the group's largest receive and send totals and the rows per local
    expert (the ``RES_*`` words), then releases ``res[RES_SEQ] = seq`` for the host to poll."""
    R = signals["hdr_delta"].shape[0]
    _notify_recv_launch[(1,)](t32, t64, num_worst_tokens, res if res is not None else t64, seq, experts_per_rank,
                              *sync_args(signals, 0, 0, t64), R=R, USE_CLOCK=use_clock(signals),
                              HOST_OUT=res is not None, BLOCK_E=min(pow2(experts_per_rank), 1024),
                              num_warps=1 if res is None else 4)


def notify(counts: torch.Tensor, num_experts: int, t32: torch.Tensor, t64: torch.Tensor, signals: dict,
           experts: bool = False, num_worst_tokens: int = 0, res: torch.Tensor = None, seq: int = 0,
           num_worst_rx: int = 0) -> None:
    """:func:`notify_send` then :func:`notify_recv` as one launch of one program (same arguments; ``num_worst_rx``:
    the receive's ``num_worst_tokens``; the receive's ``experts_per_rank`` is ``num_experts // R``). Its program
    waits for the other ranks' launches only, never for one of its own, but a rank simulated in one process runs
    it to its end before the next rank's: real ranks only."""
    R = signals["hdr_delta"].shape[0]
    _check_experts(experts, num_experts)
    _notify_launch[(1,)](counts, num_experts, num_experts // R, num_worst_tokens, t32, t64, num_worst_rx,
                         res if res is not None else t64, seq, signals["hdr"], signals["hdr_delta"], signals["host"],
                         signals["me"], signals["timeout_ns"], R=R, USE_CLOCK=use_clock(signals), EXPERTS=experts,
                         HOST_OUT=res is not None, BLOCK_E=min(pow2(num_experts // R if experts else 1), 1024),
                         BLOCK_EX=min(pow2(num_experts // R), 1024), num_warps=4 if (experts or res is not None) else 1)
