"""Routing layout: per-rank and per-expert counts, ``is_token_in_rank`` and the send positions.

Semantics: DeepEP's ``get_dispatch_layout`` (see :func:`triton_ep.reference.get_dispatch_layout`), plus
``send_pos[t, r]``: the index of token ``t`` among the tokens this rank sends to rank ``r`` (its row offset
within this rank's group on the receiver), ``-1`` where ``t`` does not go to ``r``.

No program waits on another, and (up to ``histogram_max_bins``, below) there is no memset and no atomic.
One launch when the tokens fit one block. Up to ``scan_tokens`` tokens, also one launch over blocks of ``BLOCK_T``
tokens (*scan* mode): each program reads every id (all ``T`` rows, in tiles of ``SCAN_T``): the tokens of the blocks
before its own give its prefix of tokens per rank, and its slice ``[pid * EB, (pid + 1) * EB)`` of the ``E + 1``
bins is counted over all tokens; then it stores its block's ``is_token_in_rank`` and ``send_pos``, and the last
program the per-rank totals. Each program reads ``T x K`` ids (from L2: the same ids for every program), so the
launch's time grows with ``T``; past ``scan_tokens`` two launches over blocks of ``BLOCK_T`` tokens:

1. ``_layout_block_kernel``: per block, ``is_token_in_rank``, the block's tokens per rank, and the block's
   histogram of its ids over ``E + 1`` bins (bin ``E`` counts the ids outside ``[-1, E)``), stored as one
   row of a ``[blocks, E + 1]`` scratch. With a single block it also finishes the job (step 2).
2. ``_layout_pos_kernel``: per block, the exclusive prefix of the earlier blocks' counts plus an in-block
   cumulative sum gives ``send_pos``; program ``p`` also sums the histogram rows over all blocks for its
   slice of the ``E + 1`` bins; the last program writes the per-rank totals.

With more than ``histogram_max_bins`` bins (``E + 2`` rounded up to a power of two) the per-block
histograms would cost too many registers; the counts are then zeroed (one memset) and step 1 adds each id
with an integer atomic instead. Every count is an integer sum, so nothing depends on the tiling or the
order programs run in.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from . import names
from .launch import Launcher, bound
from ._util import cdiv, pow2, tuning


@triton.jit
def _in_rank_tile(idx_ptr, t, mt, num_experts, offs_r, K: tl.constexpr, EPR: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK: tl.constexpr):
    """``[BLOCK, BLOCK_R]`` int32: 1 where token ``t`` has an id on rank ``r``; ids outside ``[0, E)`` count
    nowhere. Up to 64 ranks a token's ranks are first gathered as bits of one int64 (``K`` shifts instead
    of ``K * R`` compares)."""
    if BLOCK_R <= 64:
        bits = tl.zeros([BLOCK], dtype=tl.int64)
        for k in tl.static_range(K):
            ids = tl.load(idx_ptr + t * K + k, mask=mt, other=-1).to(tl.int64)
            valid = (ids >= 0) & (ids < num_experts)
            rank = tl.where(valid, ids, 0).to(tl.int32) // EPR     # int32 division by a constant
            bits = bits | tl.where(valid, tl.full([BLOCK], 1, tl.int64) << rank.to(tl.int64), 0)
        in_rank = ((bits[:, None] >> offs_r[None, :].to(tl.int64)) & 1).to(tl.int32)
    else:
        in_rank = tl.zeros([BLOCK, BLOCK_R], dtype=tl.int32)
        for k in tl.static_range(K):
            ids = tl.load(idx_ptr + t * K + k, mask=mt, other=-1).to(tl.int64)
            valid = (ids >= 0) & (ids < num_experts)
            rank = tl.where(valid, tl.where(valid, ids, 0).to(tl.int32) // EPR, -1)
            in_rank = tl.maximum(in_rank, (rank[:, None] == offs_r[None, :]).to(tl.int32))
    return in_rank


@triton.jit
def _positions(in_rank, t, mt, offs_r, prefix, send_pos_ptr, R: tl.constexpr):
    """Store ``send_pos`` of tile ``t`` (``prefix`` + in-tile cumulative sum - 1, or -1), as int32 (DeepEP's
    ``send_head`` dtype; a position is below ``T``); the address ``t * R + r`` stays int64."""
    pos = prefix[None, :] + tl.cumsum(in_rank, axis=0).to(tl.int64) - 1
    mtr = mt[:, None] & (offs_r < R)[None, :]
    tl.store(send_pos_ptr + t[:, None] * R + offs_r[None, :], tl.where(in_rank > 0, pos, -1).to(tl.int32), mask=mtr)


@triton.jit
def _bins(ids, mk, num_experts):
    """Histogram bins of ids ``ids`` (``mk``: real entries): ``[0, E)`` the experts, ``E`` the bad ids (outside
    ``[-1, E)``), ``E + 1`` the ``-1`` entries and padding."""
    valid = (ids >= 0) & (ids < num_experts)
    return tl.where(valid, ids, tl.where(mk & (ids != -1), num_experts, num_experts + 1)).to(tl.int32)


@triton.jit
def _scan_finish(idx_ptr, T, num_experts, in_rank, tot, t, mt, offs_r, send_pos_ptr, counts_ptr, pid,
                 K: tl.constexpr, R: tl.constexpr, EPR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, SCAN_T: tl.constexpr, EB: tl.constexpr):
    """Scan mode's rest of program ``pid`` (its block's ``in_rank`` tile and totals ``tot`` done): one pass over
    every id in tiles of ``SCAN_T`` tokens sums the tokens per rank of the earlier blocks (this block's prefix) and
    counts this program's ``EB`` bins ``[pid * EB, (pid + 1) * EB)`` of the ``E + 1`` (an id outside the slice goes
    to the extra bins ``[EB, 2 EB)``, not stored); then this block's ``send_pos``, and the last program's per-rank
    totals. Integer sums only: nothing depends on the tiles or the order programs run in."""
    before = pid.to(tl.int64) * BLOCK_T          # tokens of the earlier blocks
    lo_e = pid * EB
    ok = tl.arange(0, BLOCK_K)
    pre = tl.zeros([BLOCK_R], dtype=tl.int32)
    hist = tl.zeros([2 * EB], dtype=tl.int32)
    for s0 in range(0, T, SCAN_T):
        ts = s0 + tl.arange(0, SCAN_T).to(tl.int64)
        ms = ts < T
        if s0 < before:
            pre += tl.sum(_in_rank_tile(idx_ptr, ts, ms & (ts < before), num_experts, offs_r, K, EPR, BLOCK_R,
                                        SCAN_T), axis=0)
        mk = ms[:, None] & (ok < K)[None, :]
        ids = tl.load(idx_ptr + ts[:, None] * K + ok[None, :], mask=mk, other=-1).to(tl.int64)
        local = _bins(ids, mk, num_experts) - lo_e
        local = tl.where((local >= 0) & (local < EB) & (local + lo_e <= num_experts), local, EB)
        hist += tl.histogram(tl.reshape(local, [SCAN_T * BLOCK_K]), 2 * EB)
    offs_h = tl.arange(0, 2 * EB)
    tl.store(counts_ptr + R + lo_e + offs_h, hist, mask=(offs_h < EB) & (lo_e + offs_h <= num_experts))
    prefix = pre.to(tl.int64)
    _positions(in_rank, t, mt, offs_r, prefix, send_pos_ptr, R)
    if pid == tl.num_programs(0) - 1:
        tl.store(counts_ptr + offs_r, (prefix + tot).to(tl.int32), mask=offs_r < R)


@names.jit('layout', do_not_specialize=['T'])
def _layout_block_kernel(idx_ptr, T, num_experts, in_rank_ptr, block_rank_ptr, block_hist_ptr, send_pos_ptr,
                         counts_ptr, K: tl.constexpr, R: tl.constexpr, EPR: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr, NBINS: tl.constexpr, BLOCK_T: tl.constexpr, SINGLE: tl.constexpr,
                         ATOMIC: tl.constexpr, SCAN: tl.constexpr = False, SCAN_T: tl.constexpr = 16,
                         EB: tl.constexpr = 16):
    in_rank_ptr = in_rank_ptr.to(tl.pointer_type(tl.int8), bitcast=True)     # (bool as bytes: no view per call)
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    offs_r = tl.arange(0, BLOCK_R)
    in_rank = _in_rank_tile(idx_ptr, t, mt, num_experts, offs_r, K, EPR, BLOCK_R, BLOCK_T)
    tl.store(in_rank_ptr + t[:, None] * R + offs_r[None, :], in_rank.to(tl.int8),
             mask=mt[:, None] & (offs_r < R)[None, :])
    tot = tl.sum(in_rank, axis=0)
    if SCAN:        # one launch of several blocks: every program reads all the ids (see the module's docstring)
        _scan_finish(idx_ptr, T, num_experts, in_rank, tot, t, mt, offs_r, send_pos_ptr, counts_ptr, pid,
                     K, R, EPR, BLOCK_R, BLOCK_K, BLOCK_T, SCAN_T, EB)
    else:
        # the block's histogram (bins of :func:`_bins`)
        ok = tl.arange(0, BLOCK_K)
        mk = mt[:, None] & (ok < K)[None, :]
        bins = _bins(tl.load(idx_ptr + t[:, None] * K + ok[None, :], mask=mk, other=-1).to(tl.int64), mk,
                     num_experts)
        if ATOMIC:      # many experts: integer atomic adds into the zeroed counts instead of a block histogram
            tl.atomic_add(counts_ptr + R + bins, tl.full([BLOCK_T, BLOCK_K], 1, tl.int32),
                          mask=bins <= num_experts)
        else:
            hist = tl.histogram(tl.reshape(bins, [BLOCK_T * BLOCK_K]), NBINS)
            offs_b = tl.arange(0, NBINS)
        if SINGLE:      # the only block: finish here
            _positions(in_rank, t, mt, offs_r, tl.zeros([BLOCK_R], dtype=tl.int64), send_pos_ptr, R)
            tl.store(counts_ptr + offs_r, tot, mask=offs_r < R)
            if not ATOMIC:
                tl.store(counts_ptr + R + offs_b, hist, mask=offs_b <= num_experts)
        else:
            tl.store(block_rank_ptr + pid * BLOCK_R + offs_r, tot)
            if not ATOMIC:
                tl.store(block_hist_ptr + pid.to(tl.int64) * (num_experts + 1) + offs_b, hist,
                         mask=offs_b <= num_experts)


_layout_block_launch = Launcher(_layout_block_kernel)


@names.jit('layout', do_not_specialize=['T', 'num_blocks'])
def _layout_pos_kernel(in_rank_ptr, T, num_experts, num_blocks, block_rank_ptr, block_hist_ptr, send_pos_ptr,
                       counts_ptr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_B: tl.constexpr, EB: tl.constexpr, ATOMIC: tl.constexpr):
    in_rank_ptr = in_rank_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    pid = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_b = tl.arange(0, BLOCK_B)
    if not ATOMIC:
        # this program's slice [pid * EB, (pid + 1) * EB) of the E + 1 bins, summed over the blocks
        offs_e = pid * EB + tl.arange(0, EB)
        me = offs_e <= num_experts
        acc = tl.zeros([BLOCK_B, EB], dtype=tl.int32)
        for b0 in range(0, num_blocks, BLOCK_B):
            b = b0 + offs_b
            acc += tl.load(block_hist_ptr + b[:, None].to(tl.int64) * (num_experts + 1) + offs_e[None, :],
                           mask=(b < num_blocks)[:, None] & me[None, :], other=0)
        tl.store(counts_ptr + R + offs_e, tl.sum(acc, axis=0), mask=me)
    # the prefix of the earlier blocks, then this block's positions
    pre = tl.zeros([BLOCK_B, BLOCK_R], dtype=tl.int32)
    for b0 in range(0, pid, BLOCK_B):
        b = b0 + offs_b
        pre += tl.load(block_rank_ptr + b[:, None] * BLOCK_R + offs_r[None, :], mask=(b < pid)[:, None], other=0)
    prefix = tl.sum(pre, axis=0).to(tl.int64)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    mtr = mt[:, None] & (offs_r < R)[None, :]
    in_rank = tl.load(in_rank_ptr + t[:, None] * R + offs_r[None, :], mask=mtr, other=0).to(tl.int32)
    _positions(in_rank, t, mt, offs_r, prefix, send_pos_ptr, R)
    if pid == num_blocks - 1:
        tl.store(counts_ptr + offs_r, (prefix + tl.sum(in_rank, axis=0)).to(tl.int32), mask=offs_r < R)


_layout_pos_launch = Launcher(_layout_pos_kernel)


_BLOCK_BOUND: dict = {}
_POS_BOUND: dict = {}


def routing_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, plan: bool = False):
    """Launch the layout kernels (one launch when ``T`` fits one block or, with several blocks, up to the tuning
    table's ``scan_tokens``; else two).

    Args:
        topk_idx: ``[T, K]`` int32 or int64, contiguous, on the kernels' device; ``T`` may be 0.
        num_experts: ``E``; must be a multiple of ``num_ranks`` (checked by the caller).
        num_ranks: ``R >= 1``.
        plan: also return a :class:`LayoutPlan` that makes the same launches for another ``topk_idx`` of this
            shape and dtype (``(results, plan)``).

    Raises:
        ValueError: ``topk_idx`` is not contiguous.

    Returns:
        ``num_tokens_per_rank`` int32 ``[R]``, ``num_tokens_per_expert`` int32 ``[E]``, ``is_token_in_rank``
        bool ``[T, R]``, ``send_pos`` int32 ``[T, R]`` and ``num_bad`` int32 ``[1]`` (ids outside
        ``[-1, E)``, masked as if they were ``-1``), and ``counts`` int32 ``[R + E + 1]``: the three counts
        in one tensor (the first, second and fifth results are views of it), for one copy to the host.
        Nothing is synchronised with the host.
    """
    if not topk_idx.is_contiguous():
        raise ValueError("routing_layout needs a contiguous topk_idx")
    num_experts, num_ranks = int(num_experts), int(num_ranks)      # numpy integers are not Triton scalars
    T, K = topk_idx.shape
    cfg = tuning("layout")
    # up to one_launch_tokens: one block, one launch (decode batches); else blocks of block_t
    bt = pow2(T, 16) if T <= int(cfg["one_launch_tokens"]) else int(cfg["block_t"])
    nb = max(cdiv(T, bt), 1)
    br, nbins = pow2(num_ranks), pow2(num_experts + 2, 32)
    # past histogram_max_bins a block histogram costs too much (registers per bin): atomics into zeroed counts
    atomic = nbins > int(cfg["histogram_max_bins"])
    # several blocks up to scan_tokens: one launch, every program reading all the ids (the module's docstring)
    scan = nb > 1 and not atomic and T <= int(cfg["scan_tokens"])
    two = nb > 1 and not scan
    sizes = (T, num_ranks, num_experts, nb if two else 1, br, atomic)      # (scratch only for two launches)
    out = _outputs(sizes, topk_idx)
    counts, in_rank, send_pos, per_rank, per_expert, bad, block_rank, block_hist = out
    st, eb = (min(pow2(T), int(cfg["scan_block_t"])), pow2(cdiv(num_experts + 1, nb))) if scan else (16, 16)
    key = (nb, bt, K, num_ranks, num_experts, atomic, cfg["num_warps"], scan, st)
    launch = bound(_BLOCK_BOUND, key, lambda: _layout_block_launch.bind(
        (nb,), num_warps=cfg["num_warps"], K=K, R=num_ranks, EPR=num_experts // num_ranks, BLOCK_R=br,
        BLOCK_K=pow2(K), NBINS=nbins, BLOCK_T=bt, SINGLE=nb == 1, ATOMIC=atomic, SCAN=scan, SCAN_T=st, EB=eb))
    made = [(launch, (topk_idx, T, num_experts, in_rank, block_rank, block_hist, send_pos, counts))]
    launch(*made[0][1])
    if two:
        bb = min(pow2(nb), int(cfg["block_b"]))
        pos = bound(_POS_BOUND, key + (bb,), lambda: _layout_pos_launch.bind(
            (nb,), num_warps=cfg["num_warps"], R=num_ranks, BLOCK_R=br, BLOCK_T=bt, BLOCK_B=bb,
            EB=pow2(cdiv(num_experts + 1, nb)), ATOMIC=atomic))
        made.append((pos, (in_rank, T, num_experts, nb, block_rank, block_hist, send_pos, counts)))
        pos(*made[1][1])
    results = per_rank, per_expert, in_rank, send_pos, bad, counts
    if not plan:
        return results
    vary = (topk_idx, counts, in_rank, send_pos) + ((block_rank, block_hist) if two else ())
    return results, LayoutPlan(sizes, tuple(la.replay(args, vary) for la, args in made))


def _outputs(sizes: tuple, like: torch.Tensor) -> tuple:
    """The layout's outputs and scratch, on the device of ``like`` (``topk_idx``), for ``sizes``
    (:func:`routing_layout`'s ``T, R, E``, blocks, ranks rounded up, atomics): ``counts, in_rank, send_pos``, the three views of ``counts`` and the blocks' scratch (``counts``
    again with one block: its pointers are not read)."""
    T, num_ranks, num_experts, nb, br, atomic = sizes
    # (new_empty / new_zeros of ``like``: on one H100, one rank, benchmarks/host_cost.py --against, the layout took
    # 0.93 / 0.98 of the host µs it took with torch.empty(..., device=) at T 128 / 4096)
    alloc = like.new_zeros if atomic else like.new_empty
    counts = alloc(num_ranks + num_experts + 1, dtype=torch.int32)   # per rank, per expert, bad
    in_rank = like.new_empty((T, num_ranks), dtype=torch.bool)
    send_pos = like.new_empty((T, num_ranks), dtype=torch.int32)   # the handle's send_head (DeepEP: int32)
    # (one op for the three views: each view costs host time on a GPU machine)
    per_rank, per_expert, bad = counts.split_with_sizes((num_ranks, num_experts, 1))
    # scratch: the blocks' tokens per rank, then their histograms (unused with one block)
    if nb > 1:
        scratch = like.new_empty(nb * (br + (0 if atomic else num_experts + 1)), dtype=torch.int32)
        block_rank, block_hist = scratch.split_with_sizes((nb * br, scratch.numel() - nb * br))
    else:           # one block: no scratch (the pointers are not read; counts stands in)
        block_rank = block_hist = counts
    return counts, in_rank, send_pos, per_rank, per_expert, bad, block_rank, block_hist


class LayoutPlan:
    """:func:`routing_layout`'s launches for one shape of ``topk_idx`` (``routing_layout(..., plan=True)``), made
    again for another ``topk_idx`` of that shape and dtype: fresh outputs, the launches replayed
    (:class:`triton_ep.kernels.launch.Replay`), no key worked out."""

    __slots__ = ("sizes", "launches")

    def __init__(self, sizes: tuple, launches: tuple) -> None:
        self.sizes, self.launches = sizes, launches

    def __call__(self, topk_idx: torch.Tensor) -> tuple:
        """:func:`routing_layout`'s results for ``topk_idx`` (contiguous, of the planned shape and dtype)."""
        counts, in_rank, send_pos, per_rank, per_expert, bad, block_rank, block_hist = _outputs(self.sizes, topk_idx)
        ts = (topk_idx, counts, in_rank, send_pos) + ((block_rank, block_hist) if self.sizes[3] > 1 else ())
        for launch in self.launches:
            launch(*ts)
        return per_rank, per_expert, in_rank, send_pos, bad, counts
