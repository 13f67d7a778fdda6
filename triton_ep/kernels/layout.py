"""Routing layout: per-rank and per-expert counts, ``is_token_in_rank`` and the send positions.

Semantics: DeepEP's ``get_dispatch_layout`` (see :func:`triton_ep.reference.get_dispatch_layout`), plus
``send_pos[t, r]``: the index of token ``t`` among the tokens this rank sends to rank ``r`` (its row offset
within this rank's group on the receiver), ``-1`` where ``t`` does not go to ``r``.

One launch, no memset, no atomics, and no program waits on another. The tokens are cut into ``P``
contiguous chunks, one per program (``P`` at most ``max_programs``); program ``p``:

1. scans every token in tiles of ``BLOCK_S``: it sums ``is_token_in_rank`` over the tokens before its
   chunk (the exclusive prefix of its chunk, recomputed by every program instead of exchanged), and
   histograms the ids of its own slice of experts ``[p * EB, (p + 1) * EB)`` over all tokens;
2. walks its own chunk in tiles of ``BLOCK_T``: cumulative sums plus the running prefix give
   ``send_pos``; it writes ``is_token_in_rank`` there;
3. the last program writes the per-rank totals, program 0 the count of ids outside ``[-1, E)``.

Every count is an integer sum, so nothing depends on the tiling. The redundant scan costs each program
one read of the ``[T, K]`` ids (L2-resident after the first program touches them); with ``P`` capped the
work grows linearly in ``T``. At ``T = 4096`` on the H200 that is 16 programs of 4 tiles each, one launch
(benchmarks/bench_kernels.py measures it).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ._util import pow2, tuning


@triton.jit
def _or(a, b):
    return a | b


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
def _layout_kernel(idx_ptr, T, chunk, num_experts, in_rank_ptr, send_pos_ptr, tok_per_rank_ptr,
                   per_expert_ptr, bad_ptr, K: tl.constexpr, R: tl.constexpr, EPR: tl.constexpr,
                   BLOCK_R: tl.constexpr, EB: tl.constexpr, NBINS: tl.constexpr, HISTOGRAM: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, T)
    offs_r = tl.arange(0, BLOCK_R)
    e_lo = pid.to(tl.int64) * EB
    offs_e = tl.arange(0, NBINS)
    # 1. prefix of the earlier chunks (per rank) and this program's slice of the expert histogram
    prefix = tl.zeros([BLOCK_R], dtype=tl.int64)
    hist = tl.zeros([NBINS], dtype=tl.int32)
    bad = tl.zeros([BLOCK_S], dtype=tl.int32)
    for s in range(0, T, BLOCK_S):
        t = s + tl.arange(0, BLOCK_S).to(tl.int64)
        mt = t < T
        if s < start:
            in_rank = _in_rank_tile(idx_ptr, t, t < start, num_experts, offs_r, K, EPR, BLOCK_R, BLOCK_S)
            prefix += tl.sum(in_rank, axis=0).to(tl.int64)
        for k in tl.static_range(K):
            ids = tl.load(idx_ptr + t * K + k, mask=mt, other=-1).to(tl.int64)
            mine = (ids >= e_lo) & (ids < e_lo + EB) & (ids < num_experts)
            local = tl.where(mine, ids - e_lo, EB).to(tl.int32)
            if HISTOGRAM:   # bin EB collects every id outside this program's slice; it is not stored
                hist += tl.histogram(local, NBINS)
            else:
                hist += tl.sum((local[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
            bad += (mt & ((ids < -1) | (ids >= num_experts))).to(tl.int32)
    tl.store(per_expert_ptr + e_lo + offs_e, hist, mask=(offs_e < EB) & (e_lo + offs_e < num_experts))
    if pid == 0:
        tl.store(bad_ptr, tl.sum(bad, axis=0))
    # 2. this program's chunk: send positions and is_token_in_rank
    mr = offs_r < R
    for s in range(start, end, BLOCK_T):
        t = s + tl.arange(0, BLOCK_T).to(tl.int64)
        mt = t < end
        in_rank = _in_rank_tile(idx_ptr, t, mt, num_experts, offs_r, K, EPR, BLOCK_R, BLOCK_T)
        pos = prefix[None, :] + tl.cumsum(in_rank, axis=0).to(tl.int64) - 1
        mtr = mt[:, None] & mr[None, :]
        tl.store(send_pos_ptr + t[:, None] * R + offs_r[None, :], tl.where(in_rank > 0, pos, -1), mask=mtr)
        tl.store(in_rank_ptr + t[:, None] * R + offs_r[None, :], in_rank.to(tl.int8), mask=mtr)
        prefix += tl.sum(in_rank, axis=0).to(tl.int64)
    # 3. the last chunk's prefix is the total
    if pid == tl.num_programs(0) - 1:
        tl.store(tok_per_rank_ptr + offs_r, prefix.to(tl.int32), mask=mr)


def layout_grid(T: int, num_experts: int, block_t: int, max_programs: int) -> Tuple[int, int, int]:
    """``(programs, tokens per program, experts per program)`` of one layout launch: chunks are whole
    ``block_t`` tiles, at most ``max_programs`` of them (at least one program, also for ``T = 0``), and the
    experts are split in equal power-of-two slices so that the programs cover all ``num_experts``."""
    tiles = max(triton.cdiv(T, block_t), 1)
    per_prog = triton.cdiv(tiles, max(int(max_programs), 1))
    programs = triton.cdiv(tiles, per_prog)
    return programs, per_prog * block_t, pow2(triton.cdiv(num_experts, programs))


def routing_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the layout kernel (one launch).

    Args:
        topk_idx: ``[T, K]`` int32 or int64, contiguous, on the kernels' device; ``T`` may be 0.
        num_experts: ``E``; must be a multiple of ``num_ranks`` (checked by the caller).
        num_ranks: ``R >= 1``.

    Returns:
        ``num_tokens_per_rank`` int32 ``[R]``, ``num_tokens_per_expert`` int32 ``[E]``, ``is_token_in_rank``
        bool ``[T, R]``, ``send_pos`` int64 ``[T, R]`` and ``num_bad`` int32 ``[1]`` (ids outside
        ``[-1, E)``, masked as if they were ``-1``). Nothing is synchronised with the host.
    """
    T, K = topk_idx.shape
    dev = topk_idx.device
    cfg = tuning("layout")
    programs, chunk, eb = layout_grid(T, num_experts, cfg["block_t"], cfg["max_programs"])
    counts = torch.empty(num_ranks + num_experts + 1, dtype=torch.int32, device=dev)   # per rank, per expert, bad
    in_rank = torch.empty((T, num_ranks), dtype=torch.bool, device=dev)
    send_pos = torch.empty((T, num_ranks), dtype=torch.int64, device=dev)
    per_rank, per_expert, bad = counts[:num_ranks], counts[num_ranks:-1], counts[-1:]
    hist = cfg["expert_count"] == "histogram"
    _layout_kernel[(programs,)](topk_idx, T, chunk, num_experts, in_rank.view(torch.int8), send_pos, per_rank,
                                per_expert, bad, K=K, R=num_ranks, EPR=num_experts // num_ranks,
                                BLOCK_R=pow2(num_ranks), EB=eb, NBINS=max(2 * eb, 32) if hist else pow2(eb + 1),
                                HISTOGRAM=hist, BLOCK_S=min(cfg["block_s"], pow2(T)), BLOCK_T=cfg["block_t"],
                                num_warps=cfg["num_warps"])
    return per_rank, per_expert, in_rank, send_pos, bad
