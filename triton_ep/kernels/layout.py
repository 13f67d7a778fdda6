"""Routing layout: per-rank and per-expert counts, ``is_token_in_rank`` and the send positions.

Semantics: DeepEP's ``get_dispatch_layout`` (see :func:`triton_ep.reference.get_dispatch_layout`), plus
``send_pos[t, r]``: the index of token ``t`` among the tokens this rank sends to rank ``r`` (its row offset
within this rank's group on the receiver), ``-1`` where ``t`` does not go to ``r``.

Two launches over blocks of tokens (no program waits on another):

1. ``_layout_count_kernel``: per block, ``is_token_in_rank`` and the block's tokens per rank; the expert
   histogram (and, in one extra bin, the ids outside ``[-1, E)``) by integer atomic adds into a zeroed
   array: integer sums, so the result does not depend on their order.
2. ``_layout_pos_kernel``: per block, the exclusive prefix of the earlier blocks' counts plus an in-block
   cumulative sum gives ``send_pos``; block 0 also writes the per-rank totals.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ._util import pow2, tuning


@triton.jit
def _layout_count_kernel(idx_ptr, T, num_experts, experts_per_rank, in_rank_ptr, block_rank_ptr, hist_ptr,
                         K: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    offs_r = tl.arange(0, BLOCK_R)
    in_rank = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.int32)
    for k in tl.static_range(K):
        ids = tl.load(idx_ptr + t * K + k, mask=mt, other=-1).to(tl.int64)
        valid = mt & (ids >= 0) & (ids < num_experts)
        bad = mt & ((ids < -1) | (ids >= num_experts))
        rank = tl.where(valid, ids // experts_per_rank, -1)
        in_rank = tl.maximum(in_rank, (rank[:, None] == offs_r[None, :]).to(tl.int32))
        # bin E counts the bad ids; -1 entries count nowhere
        tl.atomic_add(hist_ptr + tl.where(valid, ids, num_experts), 1, mask=valid | bad)
    mr = offs_r < R
    tl.store(in_rank_ptr + t[:, None] * R + offs_r[None, :], in_rank.to(tl.int8), mask=mt[:, None] & mr[None, :])
    tl.store(block_rank_ptr + pid * BLOCK_R + offs_r, tl.sum(in_rank, axis=0))


@triton.jit
def _layout_pos_kernel(in_rank_ptr, T, num_blocks, block_rank_ptr, send_pos_ptr, tok_per_rank_ptr,
                       R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_b = tl.arange(0, BLOCK_B)
    prefix = tl.zeros([BLOCK_R], dtype=tl.int64)
    for b0 in range(0, pid, BLOCK_B):
        b = b0 + offs_b
        c = tl.load(block_rank_ptr + b[:, None] * BLOCK_R + offs_r[None, :], mask=(b < pid)[:, None], other=0)
        prefix += tl.sum(c.to(tl.int64), axis=0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    mtr = mt[:, None] & (offs_r < R)[None, :]
    in_rank = tl.load(in_rank_ptr + t[:, None] * R + offs_r[None, :], mask=mtr, other=0).to(tl.int32)
    pos = prefix[None, :] + tl.cumsum(in_rank, axis=0).to(tl.int64) - 1
    tl.store(send_pos_ptr + t[:, None] * R + offs_r[None, :], tl.where(in_rank > 0, pos, -1), mask=mtr)
    if pid == 0:
        tot = tl.zeros([BLOCK_R], dtype=tl.int32)
        for b0 in range(0, num_blocks, BLOCK_B):
            b = b0 + offs_b
            tot += tl.sum(tl.load(block_rank_ptr + b[:, None] * BLOCK_R + offs_r[None, :],
                                  mask=(b < num_blocks)[:, None], other=0), axis=0)
        tl.store(tok_per_rank_ptr + offs_r, tot, mask=offs_r < R)


def routing_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the layout kernels.

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
    block_t = cfg["block_t"]
    block_r = pow2(num_ranks)
    nb = max(triton.cdiv(T, block_t), 1)
    tok_per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    hist = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)      # [E] counts, then bad ids
    in_rank = torch.empty((T, num_ranks), dtype=torch.bool, device=dev)
    send_pos = torch.empty((T, num_ranks), dtype=torch.int64, device=dev)
    block_rank = torch.empty((nb, block_r), dtype=torch.int32, device=dev)
    in_rank_i8 = in_rank.view(torch.int8)
    _layout_count_kernel[(nb,)](topk_idx, T, num_experts, num_experts // num_ranks, in_rank_i8, block_rank, hist,
                                K=K, R=num_ranks, BLOCK_T=block_t, BLOCK_R=block_r, num_warps=cfg["num_warps"])
    _layout_pos_kernel[(nb,)](in_rank_i8, T, nb, block_rank, send_pos, tok_per_rank, R=num_ranks,
                              BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_B=min(pow2(nb), cfg["block_b"]),
                              num_warps=cfg["num_warps"])
    return tok_per_rank, hist[:num_experts], in_rank, send_pos, hist[num_experts:]
