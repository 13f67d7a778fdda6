"""Plain-PyTorch semantics of DeepEP V1 normal mode over ``R`` ranks: the oracle every test uses.

Ranks are held as Python lists of per-rank tensors (index = rank). Nothing here is fast; everything
here is meant to be read. The semantics are DeepEP's (``deep_ep.Buffer.get_dispatch_layout``,
``dispatch`` and ``combine`` in normal mode), as docs/design.md section 1 restates them:

- expert ``e`` lives on rank ``e // (E // R)``; ids outside ``[0, E)`` (``-1`` included) select nothing;
- a token goes once to every rank that holds at least one of its experts;
- received rows are grouped by source rank in rank order, in the source's token order within a group;
- combine sums, in fp32 and in ascending rank order, the rows each destination rank returns for
  a token, adds the optional bias, and rounds once to bf16.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor


def _rank_of(topk_idx: Tensor, num_experts: int, num_ranks: int) -> Tensor:
    """``[T, K]`` int64: the rank holding each id, ``-1`` for ids outside ``[0, E)``."""
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < num_experts)
    return torch.where(valid, ids // (num_experts // num_ranks), torch.full_like(ids, -1))


def get_dispatch_layout(topk_idx: Tensor, num_experts: int, num_ranks: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The routing layout of one rank's tokens.

    Args:
        topk_idx: ``[T, K]`` int32 or int64 expert ids; ``-1`` (and any id outside ``[0, E)``) selects nothing.
        num_experts: ``E``, a multiple of ``num_ranks``.
        num_ranks: ``R``.

    Returns:
        ``num_tokens_per_rank`` int32 ``[R]``, ``num_tokens_per_expert`` int32 ``[E]`` (duplicate ids inside
        one token counted each time), ``is_token_in_rank`` bool ``[T, R]``.
    """
    ids = topk_idx.long().cpu()
    valid = (ids >= 0) & (ids < num_experts)
    per_expert = torch.bincount(ids[valid], minlength=num_experts).to(torch.int32)
    rank_of = _rank_of(ids, num_experts, num_ranks)
    in_rank = torch.stack([(rank_of == r).any(dim=1) for r in range(num_ranks)], dim=1) if ids.shape[0] else \
        torch.zeros((0, num_ranks), dtype=torch.bool, device="cpu")
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


XLike = Union[Tensor, Tuple[Tensor, Tensor]]


def dispatch(xs: Sequence[XLike], topk_idxs: Sequence[Tensor], topk_weights: Optional[Sequence[Tensor]],
             num_experts: int, expert_alignment: int = 1) -> List[dict]:
    """What ``Buffer.dispatch`` must give on every rank.

    Args:
        xs: per source rank, ``[T_i, H]`` rows of any dtype, or a pair (``[T_i, H]`` rows, ``[T_i, S]`` scales
            of any dtype, width and layout); rows and scales are copied bit for bit (scales row-major).
        topk_idxs: per rank, ``[T_i, K]`` int ids.
        topk_weights: per rank, ``[T_i, K]`` fp32, or ``None``.
        num_experts: ``E``.
        expert_alignment: each per-expert count is rounded up to a multiple of it.

    Returns:
        per receiving rank ``j`` a dict with ``recv_x`` (or ``(recv_x, recv_x_scales)``), ``recv_topk_idx``
        ``[N_j, K]`` of rank ``j``'s ``topk_idx`` dtype (local ids, ``-1`` where the expert lives elsewhere), ``recv_topk_weights`` fp32
        (0 where the id is ``-1``; ``None`` if no weights were given), ``num_recv_tokens_per_expert_list``,
        ``rank_prefix_matrix`` int32 ``[R, R]``, ``recv_src_idx`` int32 ``[N_j]``.
    """
    R = len(xs)
    El = num_experts // R
    pairs = [x if isinstance(x, tuple) else (x, None) for x in xs]
    layouts = [get_dispatch_layout(t, num_experts, R) for t in topk_idxs]
    counts = torch.stack([lay[0] for lay in layouts]).long()           # [R src, R dst]
    prefix = counts.cumsum(0).to(torch.int32)
    out = []
    for j in range(R):
        rows, scales, idx, wts, src = [], [], [], [], []
        for i in range(R):
            sel = layouts[i][2][:, j].nonzero().flatten()
            x_i, s_i = pairs[i]
            rows.append(x_i.cpu()[sel])
            if s_i is not None:
                scales.append(s_i.cpu()[sel])
            ids = topk_idxs[i].long().cpu()[sel]
            on_j = _rank_of(ids, num_experts, R) == j
            idx.append(torch.where(on_j, ids - j * El, torch.full_like(ids, -1)))
            if topk_weights is not None:
                w = topk_weights[i].cpu()[sel]
                wts.append(torch.where(on_j, w, torch.zeros_like(w)))
            src.append(sel.to(torch.int32))
        per_expert = sum(lay[1][j * El:(j + 1) * El].long() for lay in layouts)
        align = max(int(expert_alignment), 1)
        recv_x = torch.cat(rows)
        out.append(dict(
            recv_x=(recv_x, torch.cat(scales)) if scales else recv_x,
            recv_topk_idx=torch.cat(idx).to(topk_idxs[j].dtype),     # DeepEP: the dtype of topk_idx
            recv_topk_weights=torch.cat(wts) if topk_weights is not None else None,
            num_recv_tokens_per_expert_list=[int((c + align - 1) // align * align) for c in per_expert.tolist()],
            rank_prefix_matrix=prefix.clone(),
            recv_src_idx=torch.cat(src),
        ))
    return out


def combine(recv_xs: Sequence[Tensor], dispatched: Sequence[dict], num_tokens: Sequence[int],
            recv_topk_weights: Optional[Sequence[Tensor]] = None,
            biases: Optional[Sequence[Sequence[Tensor]]] = None,
            ranks_per_host: Optional[int] = None) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """What ``Buffer.combine`` must give on every rank.

    Args:
        recv_xs: per rank ``j``, ``[N_j, H]`` bf16 rows in the order ``dispatch`` delivered them.
        dispatched: per rank, the dict :func:`dispatch` returned (its ``rank_prefix_matrix`` and ``recv_src_idx``).
        num_tokens: ``T_i`` per source rank.
        recv_topk_weights: per rank ``[N_j, K]`` fp32 to be summed back the same way, or ``None``.
        biases: per source rank, a sequence of ``[T_i, H]`` bf16 tensors added after the sum.
        ranks_per_host: ``n`` to model internode mode's two-level sum (hosts of ranks ``[0, n)``, ``[n, 2n)``,
            ...): per host, the fp32 sum over its ranks in ascending order rounded to bf16 (weights: kept in
            fp32), then the fp32 sum of those partials over hosts in ascending order, plus the biases, rounded
            once more. ``None``: one level.

    Returns:
        per source rank ``(combined_x bf16 [T_i, H], combined_topk_weights fp32 [T_i, K] or None)``: the fp32
        sum, over destination ranks in ascending order, of the rows returned for each token, plus the biases
        (in order), rounded once to bf16.
    """
    R = len(recv_xs)
    H = recv_xs[0].shape[1]
    n = ranks_per_host or R
    results = []
    for i in range(R):
        acc = torch.zeros((num_tokens[i], H), dtype=torch.float32, device="cpu")
        wacc = None
        if recv_topk_weights is not None:
            wacc = torch.zeros((num_tokens[i], recv_topk_weights[0].shape[1]), dtype=torch.float32, device="cpu")
        for h0 in range(0, R, n):
            part, wpart = torch.zeros_like(acc), None if wacc is None else torch.zeros_like(wacc)
            for j in range(h0, h0 + n):
                m = dispatched[j]["rank_prefix_matrix"].long()
                lo = int(m[i - 1, j]) if i > 0 else 0
                hi = int(m[i, j])
                src = dispatched[j]["recv_src_idx"][lo:hi].long()
                part[src] += recv_xs[j].cpu()[lo:hi].float()
                if wpart is not None:
                    wpart[src] += recv_topk_weights[j].cpu()[lo:hi].float()
            acc += part.to(torch.bfloat16).float() if ranks_per_host else part
            if wacc is not None:
                wacc += wpart
        for b in (biases[i] if biases is not None else ()):
            acc += b.cpu().float()
        results.append((acc.to(torch.bfloat16), wacc))
    return results
