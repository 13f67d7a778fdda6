"""The device work of :class:`~triton_ep.elastic.ElasticBuffer` on this rank: V2's expanded layout (each local
expert's (token, slot) entries contiguous, its segment starting at the sum of the earlier experts' aligned counts), the
handle's tables from the V1 handle, and V2's column-major scales. Everything stays on the device (no host
synchronisation) and is deterministic (sorts, searches and scatters to distinct places)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..modes.internode import dense

Tensor = torch.Tensor
#: V2's TMA-aligned column-major scales: the token stride is 1, the pack stride the row count rounded up to this
SF_ROW_ALIGNMENT = 4


def align(v: int, a: int) -> int:
    """``v`` rounded up to a multiple of ``a``."""
    return (v + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class Expansion:
    """Where each (received row, top-k slot) goes in the expanded layout, computed on the device."""

    slots: Tensor           # int64 [N, K]: the row in the expanded layout, -1 where the expert is elsewhere
    src_row: Tensor         # int64 [rows]: per expanded row, its received row (N: none, a zero row)
    src_entry: Tensor       # int64 [rows]: per expanded row, its (row, slot) as row * K + slot (N * K: none)


def unaligned_counts(recv_topk_idx: Tensor, num_local_experts: int) -> Tensor:
    """int64 ``[E_l]``: the entries of each local expert in ``recv_topk_idx`` (``[N, K]``, ``-1`` none; duplicates
    counted each time). Device work only (a sort and a search: deterministic, no host synchronisation)."""
    flat = recv_topk_idx.reshape(-1).long()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_local_experts)).sort().values
    bounds = torch.searchsorted(key, torch.arange(num_local_experts + 1, dtype=torch.int64, device=key.device))
    return bounds[1:] - bounds[:-1]


def sources(slots: Tensor, rows: int) -> Tuple[Tensor, Tensor]:
    """Per row of an expanded layout of ``rows`` rows: the received row it holds and its entry ``row * K + slot``
    (``N`` and ``N * K`` where none: padding), from ``slots`` (``[N, K]``, ``-1`` none). Each entry elsewhere is
    scattered to a spare row of its own, so no two writes meet (deterministic)."""
    N, K = slots.shape
    flat = slots.reshape(-1)
    entry = torch.arange(N * K, dtype=torch.int64, device=slots.device)
    dest = torch.where(flat >= 0, flat, rows + entry)
    src_entry = torch.full((rows + N * K,), N * K, dtype=torch.int64, device=slots.device).scatter_(0, dest, entry)
    src_entry = src_entry[:rows]
    src_row = torch.where(src_entry < N * K, src_entry // max(K, 1), torch.full_like(src_entry, N))
    return src_row, src_entry


def expansion(recv_topk_idx: Tensor, counts: Tensor, alignment: int, rows: int) -> Expansion:
    """The expanded layout of ``recv_topk_idx`` (``[N, K]`` local ids, ``-1`` none; ``counts`` its per-expert
    entries) in ``rows`` rows: expert ``e``'s entries in (row, slot) order from ``start(e)``, the sum of the earlier
    experts' counts each rounded up to ``alignment``. Device work only: no host synchronisation."""
    N, K = recv_topk_idx.shape
    dev, El = recv_topk_idx.device, counts.shape[0]
    flat = recv_topk_idx.reshape(-1).long()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, El))              # entries elsewhere sort last
    aligned = (counts + alignment - 1) // alignment * alignment
    start = torch.cat([torch.cumsum(aligned, 0) - aligned, torch.zeros(1, dtype=torch.int64, device=dev)])
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    all_counts = torch.cat([counts, (flat < 0).sum().reshape(1)])
    first = torch.cumsum(all_counts, 0) - all_counts                            # each key's first sorted position
    rank_in_expert = torch.arange(N * K, dtype=torch.int64, device=dev) - first[sorted_key]
    slot_sorted = torch.where(sorted_key < El, start[sorted_key] + rank_in_expert, torch.full_like(sorted_key, -1))
    slots = torch.empty(N * K, dtype=torch.int64, device=dev).scatter_(0, order, slot_sorted).view(N, K)
    return Expansion(slots, *sources(slots, rows))


def gather_rows(t: Tensor, index: Tensor) -> Tensor:
    """``t``'s rows at ``index`` (``t.shape[0]`` selects a zero row), as raw bytes (any dtype, fp8 included)."""
    row_bytes = t.element_size() * (t[0].numel() if t.shape[0] else int(torch.Size(t.shape[1:]).numel()))
    raw = dense(t).view(torch.uint8).reshape(t.shape[0], row_bytes)
    ext = torch.cat([raw, torch.zeros((1, raw.shape[1]), dtype=torch.uint8, device=raw.device)])
    return ext[index].view(t.dtype).reshape(index.shape[0], *t.shape[1:])


def psum_per_rank(h1: tuple, rank: int) -> Tensor:
    """int32 ``[R]``: rows received from source ranks ``0..i`` (from the V1 handle, intranode or internode)."""
    if len(h1) == 10:                            # internode: recv_gbl_rank_prefix_sum
        return h1[6].to(torch.int32).clone()
    return h1[0][:, rank].to(torch.int32).contiguous()


def src_metadata(h1: tuple, psum_r: Tensor, recv_idx: Tensor, N_max: int, slots: Optional[Tensor]) -> Tensor:
    """``EPHandle.recv_src_metadata``, int32 ``[N, K + 2]``, from the V1 handle ``h1`` (intranode or internode),
    ``psum_r`` (:func:`psum_per_rank`), the received local ids ``recv_idx`` ``[N, K]`` and the expanded rows ``slots``
    (``[N, K]``, or ``None``: ``-1``); padding rows hold ``-1``."""
    N, K = recv_idx.shape
    dev = recv_idx.device
    if len(h1) == 10:
        src_rank, src_tok = h1[7][:, 0].long(), h1[7][:, 1].long()
    else:
        src_tok = h1[3].long()
        rows = torch.arange(N, dtype=torch.int64, device=dev)
        src_rank = torch.searchsorted(psum_r.long(), rows, right=True)
    pad = src_tok < 0
    k_iota = torch.arange(K, dtype=torch.int64, device=dev).expand(N, K)
    first = torch.where(recv_idx >= 0, k_iota, torch.full_like(k_iota, K)).amin(1) if K else \
        torch.zeros(N, dtype=torch.int64, device=dev)
    meta = torch.full((N, K + 2), -1, dtype=torch.int32, device=dev)
    neg = torch.full_like(src_tok, -1)
    meta[:, 0] = torch.where(pad, neg, src_rank * N_max + src_tok).to(torch.int32)
    meta[:, 1] = torch.where(pad, neg, src_rank * K + first).to(torch.int32)
    if slots is not None:
        meta[:, 2:] = slots.to(torch.int32)
    return meta


def col_major(sf: Tensor) -> Tensor:
    """The scales ``sf`` (``[n, S]``) as V2's TMA-aligned column-major tensor: token stride 1, pack stride ``n``
    rounded up to :data:`SF_ROW_ALIGNMENT`."""
    n, S = sf.shape
    cm = torch.empty_strided((n, S), (1, align(n, SF_ROW_ALIGNMENT)), dtype=sf.dtype, device=sf.device)
    return cm.copy_(sf)


def reduce_expanded(x: Tensor, slots: Tensor, topk_weights: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """An expanded combine's sum on this rank: per received token, the fp32 sum in top-k slot order from 0 of its rows
    of ``x`` (bf16 ``[num_expanded_tokens, H]``) at ``slots`` (``[N, K]`` expanded rows, ``-1`` none), rounded to
    bf16 ``[N, H]``; and the weights ``topk_weights`` (fp32 ``[num_expanded_tokens]``) per (token, slot), fp32
    ``[N, K]``, 0 where the slot has no row (``None`` without weights)."""
    rows, H, K = x.shape[0], x.shape[1], slots.shape[1]
    idx = torch.where(slots >= 0, slots, torch.full_like(slots, rows))
    ext = torch.cat([x, torch.zeros((1, H), dtype=x.dtype, device=x.device)])
    acc = torch.zeros((slots.shape[0], H), dtype=torch.float32, device=x.device)
    for k in range(K):
        acc += ext[idx[:, k]].float()
    w = None
    if topk_weights is not None:
        wext = torch.cat([topk_weights, torch.zeros(1, dtype=torch.float32, device=x.device)])
        w = wext[idx]
    return acc.to(torch.bfloat16), w
