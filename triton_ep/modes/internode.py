"""Normal mode across hosts (DeepEP's internode normal mode): its layout, and its arguments' checks.

Built in steps. This step groups the ranks into hosts (:mod:`triton_ep.runtime.hosts`), chooses the
transport between them, and gives ``get_dispatch_layout`` DeepEP's ``num_tokens_per_rdma_rank``. The
two-level dispatch and combine over the RDMA scheduler come next: until then ``dispatch`` and ``combine``
check their arguments and raise ``NotImplementedError`` on every rank (nothing is launched, nothing is lost).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..config import EventOverlap
from ..runtime import Runtime
from .intranode import Intranode

Tensor = torch.Tensor


class Internode:
    """Internode normal mode for one Buffer whose ranks span several hosts.

    Args:
        rt: the Buffer's runtime (``rt.hosts``: the hosts; ``rt.rdma_transport``: ``"verbs"`` or
            ``"emulated"``).
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.hosts = rt.hosts
        #: the per-rank layout is the intranode one (the same kernel): this mode adds the per-host counts
        self._local = Intranode(rt)
        order = self.hosts.rank_order
        #: ranks host by host (``None``: already so, hosts hold consecutive ranks)
        self._order = None if order == tuple(range(rt.group_size)) else torch.tensor(order, device=rt.device)

    def tokens_per_host(self, is_token_in_rank: Tensor) -> Tensor:
        """DeepEP's ``num_tokens_per_rdma_rank``: int32 ``[num_hosts]``, the tokens that go to at least one
        rank of each host, from ``is_token_in_rank`` bool ``[T, R]`` (on the device; no host wait)."""
        in_rank = is_token_in_rank if self._order is None else is_token_in_rank.index_select(1, self._order)
        T = in_rank.shape[0]
        per_host = in_rank.view(T, self.hosts.num_hosts, self.hosts.ranks_per_host).any(dim=2)
        return per_host.sum(dim=0, dtype=torch.int32)

    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """``Buffer.get_dispatch_layout`` across hosts: the intranode layout, plus ``num_tokens_per_rdma_rank``
        int32 ``[num_hosts]`` in the second place (computed on the stream the layout ran on)."""
        return self._local.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                               allocate_on_comm_stream, tokens_per_host=self.tokens_per_host)

    def check_tokens_per_host(self, num_tokens_per_rdma_rank: Optional[Tensor], required: bool) -> None:
        """Check ``num_tokens_per_rdma_rank`` (int32 ``[num_hosts]`` on the Buffer's device; ``required``:
        a dispatch without a handle needs it, as DeepEP's).

        Raises:
            ValueError / TypeError: missing where required, or the wrong dtype, shape or device.
        """
        if num_tokens_per_rdma_rank is None:
            if required:
                raise ValueError("dispatch across hosts needs num_tokens_per_rdma_rank (int32 [num_hosts], as "
                                 "get_dispatch_layout returned it) when no handle is given")
            return
        self.rt.check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, (torch.int32,),
                             (self.hosts.num_hosts,))

    def _not_built(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"rank {self.rt.rank}: {what} across hosts (internode normal mode, {self.hosts.num_hosts} hosts of "
            f"{self.hosts.ranks_per_host} ranks, {self.hosts.source}, transport {self.rt.rdma_transport!r}) is not "
            f"built yet: this version has the hosts, the transport choice and get_dispatch_layout; run dispatch "
            f"and combine with every rank on one host")

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, **kwargs):
        """``Buffer.dispatch`` across hosts: checks ``num_tokens_per_rdma_rank``, then raises.

        Raises:
            ValueError / TypeError: a bad ``num_tokens_per_rdma_rank``.
            NotImplementedError: always, after the checks (the data path is not built yet).
        """
        self.rt.live()
        self.check_tokens_per_host(num_tokens_per_rdma_rank, required=handle is None)
        raise self._not_built("dispatch")

    def combine(self, x, handle, **kwargs):
        """``Buffer.combine`` across hosts.

        Raises:
            NotImplementedError: always (no internode dispatch can have made a handle yet).
        """
        self.rt.live()
        raise self._not_built("combine")
