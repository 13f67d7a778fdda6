"""Routing layout: per-rank and per-expert counts, ``is_token_in_rank`` and the send positions.

Semantics: DeepEP's ``get_dispatch_layout`` (see :func:`triton_ep.reference.get_dispatch_layout`), plus
``send_pos[t, r]``: the index of token ``t`` among the tokens this rank sends to rank ``r`` (its row offset
within this rank's group on the receiver), ``-1`` where ``t`` does not go to ``r``.

One program walks the tokens in blocks, carrying the running per-rank counts, so the prefix sums need no
second pass and every count is computed in a fixed order (deterministic, no atomics).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ._util import interpreted, pow2


@triton.jit
def _layout_kernel(idx_ptr, T, num_experts, experts_per_rank,
                   tok_per_rank_ptr, tok_per_expert_ptr, in_rank_ptr, send_pos_ptr, num_bad_ptr,
                   K: tl.constexpr, R: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    running = tl.zeros([BLOCK_R], dtype=tl.int64)
    hist = tl.zeros([BLOCK_E], dtype=tl.int32)
    bad = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mt = offs_t < T
        mk = mt[:, None] & (offs_k[None, :] < K)
        ids = tl.load(idx_ptr + offs_t[:, None] * K + offs_k[None, :], mask=mk, other=-1).to(tl.int64)
        valid = mk & (ids >= 0) & (ids < num_experts)
        bad += (mk & ((ids < -1) | (ids >= num_experts))).to(tl.int32)
        rank = tl.where(valid, ids // experts_per_rank, -1)
        hit = (rank[:, :, None] == offs_r[None, None, :]).to(tl.int32)      # [BT, BK, BR]
        in_rank = tl.max(hit, axis=1)                                        # [BT, BR]
        pos = running[None, :] + tl.cumsum(in_rank, axis=0).to(tl.int64) - 1
        mtr = mt[:, None] & (offs_r[None, :] < R)
        out = offs_t[:, None] * R + offs_r[None, :]
        tl.store(send_pos_ptr + out, tl.where(in_rank > 0, pos, -1), mask=mtr)
        tl.store(in_rank_ptr + out, in_rank.to(tl.int8), mask=mtr)
        running += tl.sum(in_rank, axis=0).to(tl.int64)
        flat = tl.reshape(tl.where(valid, ids, num_experts).to(tl.int32), [BLOCK_T * BLOCK_K])
        hist += tl.histogram(flat, BLOCK_E)
    tl.store(tok_per_rank_ptr + offs_r, running.to(tl.int32), mask=offs_r < R)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(tok_per_expert_ptr + offs_e, hist, mask=offs_e < num_experts)
    tl.store(num_bad_ptr, tl.sum(tl.sum(bad, axis=1), axis=0))


def routing_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the layout kernel.

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
    tok_per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    tok_per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty((T, num_ranks), dtype=torch.bool, device=dev)
    send_pos = torch.empty((T, num_ranks), dtype=torch.int64, device=dev)
    num_bad = torch.empty(1, dtype=torch.int32, device=dev)
    block_k, block_r = pow2(K), pow2(num_ranks)
    # Tokens per loop step: the [BT, BK, BR] compare tile stays near 16K elements on GPU.
    block_t = 256 if interpreted() else max(16, min(256, 16384 // (block_k * block_r)))
    _layout_kernel[(1,)](topk_idx, T, num_experts, num_experts // num_ranks,
                         tok_per_rank, tok_per_expert, in_rank.view(torch.int8), send_pos, num_bad,
                         K=K, R=num_ranks, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_R=block_r,
                         BLOCK_E=pow2(num_experts + 1), num_warps=4)
    return tok_per_rank, tok_per_expert, in_rank, send_pos, num_bad
