"""What both paths of internode normal mode build and keep: the handle of a dispatch (:class:`InternodeHandle`,
made by :func:`build_handle` alone), the plan each path keeps in it for cached dispatches and combines
(:class:`HostPlan`, :class:`CapturePlan`), and the forwarding leg's results in DeepEP's order (:class:`Received`)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Union

import torch

from ...runtime.checks import HandleField
from ..intranode import DispatchHandle

Tensor = torch.Tensor


@dataclasses.dataclass
class HostPlan:
    """The plan a host-path dispatch keeps in its handle (counts known on the host)."""
    uid: str                        # the Buffer's uid
    seq: int                        # the internode call number of the dispatch that made it
    num_tokens: int                 # T: this rank's tokens
    to_host: List[Tensor]           # per host: int64 [n_h] indices of this rank's tokens sent there, ascending
    from_host: List[int]            # per host: rows this rank forwards for it
    local_handle: DispatchHandle    # the intranode dispatch of the forwarded rows
    order: Tensor                   # int64 [N]: received row i is intranode row order[i]
    num_rows: int                   # N (padding included)


@dataclasses.dataclass
class CapturePlan:
    """The plan a capture-path dispatch keeps in its handle (tensors on the device; nothing on the host).

    Attributes:
        tok: int64 ``[num_hosts, T]``: per host, this rank's tokens sent there, ascending (the first ``cnt[h]``).
        cnt: int64 ``[num_hosts]``: tokens sent to each host.  cap: ``C``, records per host's staging area.
        rx: int32 ``[num_hosts]``: records received from each host (this host: this rank's own).
        local_handle: the forwarding leg's intranode handle.  order: int64 ``[N]``: received row ``i`` is
        intranode row ``order[i]``.  num_rows: ``N`` (``W`` for a num_worst_tokens dispatch).
        ctok: int64 ``[num_hosts, m]``: per host, the forwarding leg's rows that return there in a combine
        (the first ``rx[h]``).  blocks: ``None`` where the forwarding leg took the staging areas as they are
        (``num_hosts * cap`` rows, a num_worst_tokens dispatch); else the records per host, host-known (a
        plain dispatch, whose forwarding leg took them packed one host after another).
    """
    uid: str
    seq: int
    num_tokens: int
    tok: Tensor
    cnt: Tensor
    cap: int
    rx: Tensor
    local_handle: object
    order: Tensor
    num_rows: int
    ctok: Tensor
    blocks: Optional[List[int]] = None

    @classmethod
    def of_plain(cls, uid: str, seq: int, num_tokens: int, to_host: List[Tensor], counts: List[int], local_handle,
                 order: Tensor) -> "CapturePlan":
        """The plan of a plain dispatch (counts host-known: ``to_host``, per host the int64 tokens sent there;
        ``counts``, per host the records received), so that its cached dispatches and combines take the
        capture path. Builds its device tensors once, here (a later capture copies nothing from the host)."""
        dev = order.device
        nh = len(to_host)
        tok = torch.zeros(nh, max(num_tokens, 1), dtype=torch.int64, device=dev)
        for h, t in enumerate(to_host):
            tok[h, :t.numel()] = t
        cnt = torch.tensor([t.numel() for t in to_host], dtype=torch.int64, device=dev)
        rx = torch.tensor(counts, dtype=torch.int32, device=dev)
        starts = [sum(counts[:h]) for h in range(nh)]
        m = max(max(counts), 1)
        ctok = (torch.tensor(starts, dtype=torch.int64, device=dev)[:, None]
                + torch.arange(m, dtype=torch.int64, device=dev)[None, :]).clamp(max=max(sum(counts) - 1, 0))
        return cls(uid, seq, num_tokens, tok, cnt, m, rx, local_handle, order, order.shape[0], ctok, list(counts))


@dataclasses.dataclass
class Received:
    """The forwarding leg's dispatch of a fresh (not cached) call, its rows in DeepEP's order: by global source
    rank, stable (the source's token order), padding rows last (on the device; no host synchronisation)."""
    x: Union[Tensor, tuple]         # [N, H] as x's dtype, or (that, scales [N, S])
    topk_idx: Optional[Tensor]      # [N, K] ids of this rank's experts (-1 for others), or None
    topk_weights: Optional[Tensor]  # fp32 [N, K], or None
    per_expert: list                # num_recv_tokens_per_expert_list (host-known counts; [] without them)
    local_handle: DispatchHandle    # the intranode dispatch's handle (rows in its own order)
    order: Tensor                   # int64 [N]: row i here is intranode row order[i]
    src_meta: Tensor                # int32 [N, 2]: (global source rank, source token); -1 on padding rows
    recv_from: Tensor               # int32 [R]: rows received from each rank


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

    #: the entries, as a check of a tuple given in its place names them (``Runtime.check_handle``)
    FIELDS = (HandleField("is_token_in_rank", (torch.bool,)),
              *(HandleField(name, (torch.int32,)) for name in (
                  "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix", "recv_rdma_channel_prefix_matrix",
                  "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum",
                  "recv_src_meta", "send_rdma_head", "send_nvl_head")))
    DESCRIPTION = "the handle of a normal-mode dispatch across hosts"

    def __new__(cls, items, plan):
        h = super().__new__(cls, items)
        h.plan = plan
        return h

    @property
    def buffer_uid(self) -> str:
        """The uid of the Buffer whose dispatch made it (its plan's)."""
        return self.plan.uid


def build_handle(in_rank: Tensor, sent: Tensor, recv: Tensor, got: Received, head: Tensor,
                 plan: Union[HostPlan, CapturePlan]) -> InternodeHandle:
    """The handle of a dispatch (both paths): ``in_rank`` bool ``[T, R]``; ``sent`` int32 ``[num_hosts]``, tokens
    sent to each host; ``recv`` int32 ``[num_hosts]``, records received from each host; ``got``, the forwarding
    leg's results; ``head`` int32 ``[T, num_hosts]`` (``send_rdma_head``); ``plan``, what cached calls replay."""
    return InternodeHandle((
        in_rank, sent.view(-1, 1), in_rank.sum(0, dtype=torch.int32).view(-1, 1), recv.view(-1, 1),
        torch.cumsum(recv, 0, dtype=torch.int32), got.recv_from.view(-1, 1),
        torch.cumsum(got.recv_from, 0, dtype=torch.int32), got.src_meta, head, got.local_handle.send_head), plan)
