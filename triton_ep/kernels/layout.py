"""Routing layout: per-rank and per-expert counts, ``is_token_in_rank`` and the send positions.

Semantics: DeepEP's ``get_dispatch_layout`` (see :func:`triton_ep.reference.get_dispatch_layout`), plus
``send_pos[t, r]``: the index of token ``t`` among the tokens this rank sends to rank ``r`` (its row offset
within this rank's group on the receiver), ``-1`` where ``t`` does not go to ``r``.

Two launches, each over blocks of tokens, with no atomics (every count is summed in a fixed order):

1. ``_layout_count_kernel``: per block, ``is_token_in_rank``, the block's tokens per rank, its expert
   histogram and its number of bad ids (outside ``[-1, E)``).
2. ``_layout_pos_kernel``: per block, the exclusive prefix of the earlier blocks' counts plus an in-block
   cumulative sum gives ``send_pos``; block 0 also writes the totals.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ._util import interpreted, pow2, tuning


@triton.jit
def _layout_count_kernel(idx_ptr, T, num_experts, experts_per_rank, in_rank_ptr, block_rank_ptr,
                         block_expert_ptr, block_bad_ptr,
                         K: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    offs_r = tl.arange(0, BLOCK_R)
    in_rank = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.int32)
    hist = tl.zeros([BLOCK_E], dtype=tl.int32)
    bad = tl.zeros([BLOCK_T], dtype=tl.int32)
    for k in tl.static_range(K):
        ids = tl.load(idx_ptr + t * K + k, mask=mt, other=-1).to(tl.int64)
        valid = mt & (ids >= 0) & (ids < num_experts)
        bad += (mt & ((ids < -1) | (ids >= num_experts))).to(tl.int32)
        rank = tl.where(valid, ids // experts_per_rank, -1)
        in_rank = tl.maximum(in_rank, (rank[:, None] == offs_r[None, :]).to(tl.int32))
        hist += tl.histogram(tl.where(valid, ids, num_experts).to(tl.int32), BLOCK_E)
    mr = offs_r < R
    tl.store(in_rank_ptr + t[:, None] * R + offs_r[None, :], in_rank.to(tl.int8), mask=mt[:, None] & mr[None, :])
    tl.store(block_rank_ptr + pid * BLOCK_R + offs_r, tl.sum(in_rank, axis=0))
    tl.store(block_expert_ptr + pid * BLOCK_E + tl.arange(0, BLOCK_E), hist)
    tl.store(block_bad_ptr + pid, tl.sum(bad, axis=0))


@triton.jit
def _layout_pos_kernel(in_rank_ptr, T, num_experts, num_blocks, block_rank_ptr, block_expert_ptr, block_bad_ptr,
                       send_pos_ptr, tok_per_rank_ptr, tok_per_expert_ptr, num_bad_ptr,
                       R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_B: tl.constexpr):
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
        offs_e = tl.arange(0, BLOCK_E)
        tot_r = tl.zeros([BLOCK_R], dtype=tl.int32)
        tot_e = tl.zeros([BLOCK_E], dtype=tl.int32)
        tot_bad = tl.zeros([BLOCK_B], dtype=tl.int32)
        for b0 in range(0, num_blocks, BLOCK_B):
            b = b0 + offs_b
            mb = b < num_blocks
            tot_r += tl.sum(tl.load(block_rank_ptr + b[:, None] * BLOCK_R + offs_r[None, :], mask=mb[:, None],
                                    other=0), axis=0)
            tot_e += tl.sum(tl.load(block_expert_ptr + b[:, None] * BLOCK_E + offs_e[None, :], mask=mb[:, None],
                                    other=0), axis=0)
            tot_bad += tl.load(block_bad_ptr + b, mask=mb, other=0)
        tl.store(tok_per_rank_ptr + offs_r, tot_r, mask=offs_r < R)
        tl.store(tok_per_expert_ptr + offs_e, tot_e, mask=offs_e < num_experts)
        tl.store(num_bad_ptr, tl.sum(tot_bad, axis=0))


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
    block_r, block_e = pow2(num_ranks), pow2(num_experts + 1)
    nb = max(triton.cdiv(T, block_t), 1)
    tok_per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    tok_per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty((T, num_ranks), dtype=torch.bool, device=dev)
    send_pos = torch.empty((T, num_ranks), dtype=torch.int64, device=dev)
    num_bad = torch.empty(1, dtype=torch.int32, device=dev)
    block_rank = torch.empty((nb, block_r), dtype=torch.int32, device=dev)
    block_expert = torch.empty((nb, block_e), dtype=torch.int32, device=dev)
    block_bad = torch.empty(nb, dtype=torch.int32, device=dev)
    in_rank_i8 = in_rank.view(torch.int8)
    _layout_count_kernel[(nb,)](topk_idx, T, num_experts, num_experts // num_ranks, in_rank_i8, block_rank,
                                block_expert, block_bad, K=K, R=num_ranks, BLOCK_T=block_t, BLOCK_R=block_r,
                                BLOCK_E=block_e, num_warps=cfg["num_warps"])
    _layout_pos_kernel[(nb,)](in_rank_i8, T, num_experts, nb, block_rank, block_expert, block_bad, send_pos,
                              tok_per_rank, tok_per_expert, num_bad, R=num_ranks, BLOCK_T=block_t,
                              BLOCK_R=block_r, BLOCK_E=block_e, BLOCK_B=min(pow2(nb), 16 if not interpreted() else 4096),
                              num_warps=cfg["num_warps"])
    return tok_per_rank, tok_per_expert, in_rank, send_pos, num_bad
