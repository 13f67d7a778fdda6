"""What both paths of internode normal mode build and read: the handle of a dispatch (:class:`InternodeHandle`)
and the fields of received network-leg records (:class:`~triton_ep.protocol.records.NetRecord`)."""
from __future__ import annotations

import torch

from ...protocol.records import NET_META_BYTES, NetRecord

Tensor = torch.Tensor


def byte_columns(rows: Tensor, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """Bytes ``[lo, hi)`` of each of ``rows`` (uint8 ``[n, nbytes]``) as ``dtype`` ``[n, (hi - lo) / size]``, in
    fresh memory (a slice of one row keeps its offset, which a wider dtype's view may not take)."""
    out = torch.empty((rows.shape[0], hi - lo), dtype=torch.uint8, device=rows.device)
    out.copy_(rows[:, lo:hi])
    return out.view(dtype)


def record_field(rec: NetRecord, rows: Tensor, field: str, dtype: torch.dtype) -> Tensor:
    """``field`` of the records ``rows`` (uint8 ``[n, nbytes]``) as ``dtype`` ``[n, ...]``, in fresh memory."""
    return byte_columns(rows, *rec.span(field), dtype)


def record_meta(recv_xf: Tensor) -> Tensor:
    """The meta blocks of received records (uint8 ``[N, 16 + row]``) as int32 ``[N, 4]`` (source rank,
    source token, 0, 0)."""
    return byte_columns(recv_xf, 0, NET_META_BYTES, torch.int32)


class InternodeHandle(tuple):
    """The handle of an internode dispatch: DeepEP's 10-tuple (what each entry holds below), with this
    mode's plan for cached dispatches and combine kept as attributes.

    0. ``is_token_in_rank`` bool ``[T, R]``;
    1. ``rdma_channel_prefix_matrix`` int32 ``[num_hosts, 1]``: tokens this rank sends to each host;
    2. ``gbl_channel_prefix_matrix`` int32 ``[R, 1]``: tokens this rank sends to each rank;
    3. ``recv_rdma_channel_prefix_matrix`` int32 ``[num_hosts, 1]``: tokens this rank forwards for each
       source host (its RDMA peers, and itself);
    4. ``recv_rdma_rank_prefix_sum`` int32 ``[num_hosts]``: cumulative of 3;
    5. ``recv_gbl_channel_prefix_matrix`` int32 ``[R, 1]``: rows this rank receives from each rank;
    6. ``recv_gbl_rank_prefix_sum`` int32 ``[R]``: rows received from ranks ``0..i`` (DeepEP's meaning);
    7. ``recv_src_meta`` int32 ``[N, 2]``: each received row's global source rank and source token (``-1`` on
       padding rows);
    8. ``send_rdma_head`` int32 ``[T, num_hosts]``: token ``t``'s index among the rows sent to each host (``-1``);
    9. ``send_nvl_head`` int32 ``[F, ranks per host]``: the intranode ``send_head`` of the rows this rank
       forwarded (``F`` of them).
    """

    def __new__(cls, items, plan):
        h = super().__new__(cls, items)
        h.plan = plan
        return h
