"""The forwarding leg of internode normal mode, one flow for both paths: the intranode dispatch of the records a
rank received over the network (and its own for its host), its rows put in DeepEP's order, and a cached dispatch's
rows by its plan. What differs between the paths is passed in: which staging rows hold a record (``valid``: the
capture path's fixed-size areas) and where a dispatch without ``topk_idx`` takes its per-expert counts."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...config import EventOverlap
from ..intranode_args import DispatchArgs
from .handle import InternodeHandle, Received
from .records import Forwarded, record_meta, x_rows

Tensor = torch.Tensor


def local_experts(ids_f: Tensor, num_experts: int, num_ranks: int, per_host: int, host: int, dtype,
                  valid: Optional[Tensor] = None):
    """The forwarded rows' top-k ids (int64 ``[F, K]``, global expert ids) as ids of this host's experts
    (``dtype``, ``-1`` for the others, and for every id of a row not ``valid``, bool ``[F]``), and the
    rows per host expert (int32 ``[per_host * E / R]``); no host synchronisation."""
    n = per_host * (num_experts // num_ranks)
    base = host * n
    keep = (ids_f >= base) & (ids_f < base + n)
    if valid is not None:
        keep = keep & valid[:, None]
    ids_local = torch.where(keep, ids_f - base, -1).to(dtype)
    npe = torch.zeros(n, dtype=torch.int32, device=ids_f.device)
    npe.scatter_add_(0, ids_local.clamp(min=0).view(-1).long(), keep.view(-1).to(torch.int32))
    return ids_local, npe


def forward_fresh(leg, fwd: Forwarded, a: DispatchArgs, dtype: torch.dtype, npe_f: Optional[Tensor],
                  valid: Optional[Tensor], expert_alignment: int, num_worst_tokens: int,
                  started: Optional[Callable[[], None]] = None) -> Received:
    """The forwarding leg of a dispatch without a handle (``leg``: the :class:`~.normal.Internode`): the
    intranode dispatch of ``fwd`` (only its ``valid`` rows, bool ``[F]``, where given), routed by the records'
    is_token_in_rank and their ids (as this host's experts); ``npe_f`` int32 ``[per_host * E / R]``: without
    ``topk_idx``, the per-expert counts of the forwarded rows. ``started`` is called as this rank enters the
    host's leg. Returns its rows in DeepEP's order, as ``dtype`` (the dispatch's rows') and ``a.hidden`` wide.
    ``fwd`` is released (:meth:`~.records.Forwarded.release`) once the intranode dispatch took it."""
    in_f = fwd.in_rank if valid is None else fwd.in_rank & valid[:, None]
    ids_local = None
    if a.topk_idx is not None:
        ids_local, npe_f = local_experts(fwd.ids, a.num_experts, leg.rt.group_size, leg.per_host, leg.host,
                                         a.topk_idx.dtype, valid)
    per_rank_f = in_f.sum(0, dtype=torch.int32)
    if started is not None:
        started()
    out = leg.host_ranks.run(leg.local.dispatch_steps(
        fwd.xs, None, per_rank_f, None, in_f, npe_f, ids_local, fwd.weights, expert_alignment, num_worst_tokens),
        forwarded=True)
    fwd.release()
    del in_f, ids_local
    recv_x_f, recv_idx, recv_w, per_expert_list, local_handle, _ = out
    return in_rank_order(recv_x_f, recv_idx, recv_w, per_expert_list, local_handle, dtype, a.hidden,
                         leg.rt.group_size)


def in_rank_order(recv_x_f, recv_idx: Optional[Tensor], recv_w: Optional[Tensor], per_expert: list,
                  local_handle, dtype: torch.dtype, hidden: int, num_ranks: int) -> Received:
    """The forwarding leg's received rows (``recv_x_f``: uint8 ``[N, 16 + row]``, or that with scales; their
    ids and weights ``[N, K]``) in DeepEP's order: by global source rank, stable (the source's token order);
    padding rows last. The rows come back as ``dtype`` ``[N, hidden]``; no host synchronisation."""
    recv_xf = recv_x_f[0] if isinstance(recv_x_f, tuple) else recv_x_f
    recv_sc = recv_x_f[1] if isinstance(recv_x_f, tuple) else None
    # padding rows (num_worst_tokens) carry no record
    meta = torch.where((local_handle.recv_src_idx < 0)[:, None], -1, record_meta(recv_xf))
    order = torch.sort(torch.where(meta[:, 0] >= 0, meta[:, 0].long(), num_ranks), stable=True)[1]
    x_out = x_rows(recv_xf, dtype, hidden, order)
    x_ret = x_out if recv_sc is None else (x_out, recv_sc[order])
    src_meta = meta[order][:, :2].contiguous()
    got = src_meta[:, 0] >= 0
    recv_from = torch.zeros(num_ranks, dtype=torch.int32, device=src_meta.device)
    recv_from.scatter_add_(0, torch.where(got, src_meta[:, 0], 0).long(), got.to(torch.int32))
    return Received(x_ret, recv_idx[order] if recv_idx is not None else None,
                    recv_w[order] if recv_w is not None else None, per_expert, local_handle, order, src_meta,
                    recv_from)


def dispatch_results(got: Received, handle: InternodeHandle, per_expert: bool = True) -> tuple:
    """DeepEP's six results of a dispatch without a handle (``per_expert``: with the host-known
    ``num_recv_tokens_per_expert_list``; else ``[]``)."""
    return (got.x, got.topk_idx, got.topk_weights, got.per_expert if per_expert else [], handle,
            EventOverlap(None))


def forward_cached(leg, fwd: Forwarded, plan, dtype: torch.dtype, hidden: int) -> tuple:
    """A cached dispatch's forwarding leg: the intranode cached dispatch of ``fwd.xs`` (the forwarded records'
    ``x``, with scales where there are) by ``plan``'s local handle, its rows put in ``plan.order`` as ``dtype``
    ``[N, hidden]`` (the dispatch's rows'); ``fwd`` is released once the intranode dispatch took it (as in
    :func:`forward_fresh`). Returns DeepEP's six results."""
    recv = leg.host_ranks.run(leg.local.dispatch_steps(fwd.xs, handle=plan.local_handle), forwarded=True)[0]
    fwd.release()
    recv_xf = recv[0] if isinstance(recv, tuple) else recv
    x_out = x_rows(recv_xf, dtype, hidden, plan.order)
    if isinstance(recv, tuple):
        x_out = (x_out, recv[1][plan.order])
    return x_out, None, None, None, None, EventOverlap(None)
