"""Notify: the counts of a dispatch with ``num_worst_tokens``, exchanged on the device (no host wait).

Each rank's send counts per destination (one row of the ``R x R`` matrix ``C[s][j]``) are written into
every rank's signal header (``NOTIFY``), then released with ``NOTIFIED[me] = n`` (``n``: the call's first
round). Every rank then waits for all rows and builds the handle's device tables from the matrix in the
same launch, so the whole dispatch only enqueues work (it captures in a CUDA graph).

- :func:`notify_send` (one program): bad ids in this rank's ``topk_idx`` end the call here (an error
  record, and the peers are told); else it publishes this rank's row.
- :func:`notify_recv` (one program): waits for every row, writes the handle's tables from the matrix, and
  checks that no rank receives more than ``num_worst_tokens`` rows (the same check on every rank, from
  the same matrix).

A rank's ``NOTIFY`` words are rewritten only by a later call's notify, by which time every rank has read
them: each rank reads them before its first send of the call, and the writer's previous call could not
finish before that send released its rows.
"""
import torch
import triton
import triton.language as tl

from . import flags
from .launch import Launcher
from .dispatch import sync_args, _use_clock


@triton.jit
def _notify_send_kernel(counts_ptr, num_experts, hdr, hdr_delta, host, k, sig, me, timeout_ns,
                        R: tl.constexpr, USE_CLOCK: tl.constexpr):
    n = tl.load(hdr + flags.W_BASE) + 1
    ok = tl.load(hdr + flags.W_ERR, volatile=True) == 0
    nbad = tl.load(counts_ptr + R + num_experts).to(tl.int64)
    if ok & (nbad > 0):
        flags.post_error(hdr, hdr_delta, host, flags.E_BADIDS, me, flags.STAGE_NOTIFY, n, me, R)
        ok = ok & (nbad == 0)
    if ok:
        for r in tl.static_range(R):
            peer = hdr + tl.load(hdr_delta + r)
            for j in tl.static_range(R):
                tl.store(peer + (flags.W_FIXED + 5 * R) + me * R + j, tl.load(counts_ptr + j).to(tl.int64))
            flags.release(peer + (flags.W_FIXED + 4 * R) + me, n)


_notify_send_launch = Launcher(_notify_send_kernel)


@triton.jit
def _notify_recv_kernel(t32_ptr, t64_ptr, num_worst, hdr, hdr_delta, host, k, sig, me, timeout_ns,
                        R: tl.constexpr, USE_CLOCK: tl.constexpr):
    n = tl.load(hdr + flags.W_BASE) + 1
    bad = (tl.load(hdr + flags.W_ERR, volatile=True) != 0).to(tl.int32)
    # Wait for every rank's row (a rank that failed or left ends the wait at once).
    for r in tl.static_range(R):
        if (bad == 0) & (r != me):
            st = flags.wait_at_least(hdr + (flags.W_FIXED + 4 * R) + r, n, hdr, host, r, timeout_ns, R, USE_CLOCK)
            # a peer that published its row and then failed (it found a rank over capacity, as this rank
            # will from the same matrix) does not stop this rank: the capacity error is named below
            if (st == flags.E_FAILED) & (flags.acquire(hdr + (flags.W_FIXED + 4 * R) + r) >= n):
                st = tl.full([], 0, tl.int32)
            if st != 0:
                flags.post_wait_error(hdr, hdr_delta, host, st, r, flags.STAGE_NOTIFY, n, me, R)
            bad = bad + st
    # The handle's tables, from the matrix C[s][j] (all zeros after an error: nothing will move).
    #   t32: rank_prefix_matrix [R, R] (cumulative over s), send prefix [R] (cumulative C[me]),
    #        receive start [R] (0, rpm[0][me], ..., rpm[R-2][me])
    #   t64: row_base [R] (rpm[me-1], or 0 on rank 0), combine's comb_base [R] (sum of C[i][r<me]),
    #        send_base [R] (exclusive cumulative C[me]), prefix [R] (rpm[i][me]), then n_recv [1]
    NOTIFY = hdr + (flags.W_FIXED + 5 * R)
    over = tl.full([], -1, tl.int64)
    got = tl.full([], 0, tl.int64)
    mine = tl.full([], 0, tl.int64)
    for j in tl.static_range(R):
        col = tl.full([], 0, tl.int64)
        for s in tl.static_range(R):
            col += tl.where(bad == 0, tl.load(NOTIFY + s * R + j, volatile=True), 0)
            tl.store(t32_ptr + s * R + j, col.to(tl.int32))
            tl.store(t64_ptr + j, col, mask=me == s + 1)                     # row_base = rpm[me - 1]
            tl.store(t64_ptr + 3 * R + s, col, mask=me == j)                 # prefix = rpm[:, me]
            tl.store(t32_ptr + R * R + R + s + 1, col.to(tl.int32), mask=(me == j) & (s + 1 < R))
        tl.store(t64_ptr + j, tl.zeros([], tl.int64), mask=me == 0)
        first = (over < 0) & (col > num_worst)
        got = tl.where(first, col, got)
        over = tl.where(first, j, over)
        # this rank's own row: sent to j, and before j
        c_me = tl.where(bad == 0, tl.load(NOTIFY + me * R + j, volatile=True), 0)
        tl.store(t64_ptr + 2 * R + j, mine)                                  # send_base (exclusive)
        mine += c_me
        tl.store(t32_ptr + R * R + j, mine.to(tl.int32))                    # send prefix (inclusive)
        tl.store(t64_ptr + 4 * R, col, mask=me == j)                         # n_recv = rpm[R-1][me]
    tl.store(t32_ptr + R * R + R, tl.zeros([], tl.int32))                   # receive start of rank 0
    for i in tl.static_range(R):                                             # comb_base[i] = sum C[i][r < me]
        cb = tl.full([], 0, tl.int64)
        for r in tl.static_range(R):
            cb += tl.where((bad == 0) & (r < me), tl.load(NOTIFY + i * R + r, volatile=True), 0)
        tl.store(t64_ptr + R + i, cb)
    if (bad == 0) & (over >= 0):
        tl.store(host + flags.H_INFO, got)
        flags.post_error(hdr, hdr_delta, host, flags.E_CAPACITY, over, flags.STAGE_NOTIFY, n, me, R)


_notify_recv_launch = Launcher(_notify_recv_kernel)


def notify_send(counts: torch.Tensor, num_experts: int, signals: dict) -> None:
    """Publish this rank's send counts (``counts`` int32 ``[R + E + 1]`` from ``routing_layout``: rows per
    rank, per expert, then the number of bad ids) in every rank's header."""
    R = signals["hdr_delta"].shape[0]
    _notify_send_launch[(1,)](counts, num_experts, *sync_args(signals, 0, 0, counts), R=R,
                              USE_CLOCK=_use_clock(signals), num_warps=1)


def notify_recv(t32: torch.Tensor, t64: torch.Tensor, num_worst_tokens: int, signals: dict) -> None:
    """Wait for every rank's counts and write the handle's tables: ``t32`` int32 ``[R*R + 2R]``
    (``rank_prefix_matrix``, send prefix, receive start) and ``t64`` int64 ``[4R + 1]`` (row base in each
    receiver, combine's comb_base, send_base and prefix, then the rows this rank receives). Records
    ``E_CAPACITY`` if a rank receives more than ``num_worst_tokens`` rows (the same value on every rank:
    it is part of the call's signature)."""
    R = signals["hdr_delta"].shape[0]
    _notify_recv_launch[(1,)](t32, t64, num_worst_tokens, *sync_args(signals, 0, 0, t64), R=R,
                              USE_CLOCK=_use_clock(signals), num_warps=1)
