"""The low-latency handle (DeepEP's tuple) and the one allocation a call's outputs and tables are carved from."""
from __future__ import annotations

from typing import List

import torch

from ...protocol.ll_area import Layout
from ...runtime.checks import MAX_EXPERTS, MAX_INT32, HandleField, int_arg

Tensor = torch.Tensor


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """``Buffer.get_low_latency_rdma_size_hint``: bytes of the low-latency area for these sizes (:class:`Layout`),
    rounded up to 128 bytes as DeepEP's. ``ValueError`` naming the argument for sizes no low-latency call takes."""
    vals = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    for name, v in zip(("num_max_dispatch_tokens_per_rank", "hidden", "num_ranks"), vals):
        int_arg(name, v, 1, MAX_INT32, "int32 in the kernels")
    int_arg("num_experts", num_experts, 1, MAX_EXPERTS, "the most experts a call takes")
    if num_experts % num_ranks:
        raise ValueError(f"get_low_latency_rdma_size_hint needs num_experts % num_ranks == 0, got {vals}")
    if hidden % 8:
        raise ValueError(f"get_low_latency_rdma_size_hint: hidden {hidden} is not a multiple of 8; low-latency "
                         f"calls move rows of a multiple of 16 bytes (bf16: hidden % 8 == 0; FP8: hidden % 128 == 0)")
    n = Layout(int(num_ranks), int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts)).total_bytes
    return (n + 127) // 128 * 128


def carve(device: torch.device, parts) -> List[Tensor]:
    """Uninitialised tensors ``[(dtype, shape), ...]`` on ``device`` (``parts``: a tuple of such pairs), views
    of one allocation, each starting on a 16-byte boundary (what Triton specialises pointers on). They share
    one storage: it lives until the last of them is freed. The offsets of each ``parts`` are worked out once;
    a call makes one allocation, a view of it per dtype and a strided view per part."""
    plan = _CARVE_PLANS.get(parts)
    if plan is None:
        plan = _carve_plan(parts)
        if len(_CARVE_PLANS) >= 256:
            _CARVE_PLANS.clear()
        _CARVE_PLANS[parts] = plan
    nbytes, dtypes, views = plan
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    typed = {dt: raw.view(dt) for dt in dtypes}
    return [typed[dt].as_strided(shape, stride, off) for dt, shape, stride, off in views]


def _carve_plan(parts) -> tuple:
    """``carve``'s layout of ``parts``: total bytes (a multiple of 16), the dtypes, and per part its dtype,
    shape, contiguous strides and offset in elements of its dtype."""
    views, at = [], 0
    for dtype, shape in parts:
        stride, n = [], 1
        for d in reversed(shape):
            stride.append(n)
            n *= d
        views.append((dtype, tuple(shape), tuple(reversed(stride)), at // dtype.itemsize))
        at += (dtype.itemsize * n + 15) // 16 * 16
    return max(at, 16), tuple(dict.fromkeys(dt for dt, _ in parts)), tuple(views)


#: ``carve``'s plans, by ``parts``
_CARVE_PLANS: dict = {}


class LLHandle(tuple):
    """DeepEP's low-latency handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``:

    - ``src_info`` int32 ``[E_local, R*N]``: the source token index of each received row (``-1`` past
      the expert's count);
    - ``layout_range`` int64 ``[E_local, R]``: ``begin << 32 | count`` of each source rank's rows.

    It also keeps ``ret_slot`` (int32 ``[E_local, R*N]``: where combine returns each row), ``recv_count``,
    ``num_topk``, ``num_tokens``, the Buffer that made it and ``call``, the host's number of the send that
    made it (its tables are written by that call's receive: a combine before the receive hook ran is refused).
    """

    #: the entries, as a check of a tuple given in its place names them (``Runtime.check_handle``)
    FIELDS = (HandleField("src_info", (torch.int32,)), HandleField("layout_range", (torch.int64,)),
              HandleField("num_max_dispatch_tokens_per_rank"), HandleField("hidden"), HandleField("num_experts"))
    DESCRIPTION = "the handle of a low_latency_dispatch"

    def __new__(cls, items, buffer_uid: str, ret_slot: Tensor, recv_count: Tensor, num_tokens: int, num_topk: int,
                call: int = 0):
        self = super().__new__(cls, items)
        self.buffer_uid, self.ret_slot, self.recv_count = buffer_uid, ret_slot, recv_count
        self.num_tokens, self.num_topk, self.call = num_tokens, num_topk, call
        return self

    @property
    def src_info(self) -> Tensor:
        """int32 ``[E_local, R*N]``: the handle's first element."""
        return self[0]

    @property
    def layout_range(self) -> Tensor:
        """int64 ``[E_local, R]``: the handle's second element."""
        return self[1]

    @property
    def sizes(self) -> tuple:
        """``(num_max_dispatch_tokens_per_rank, hidden, num_experts)``: the handle's last three elements."""
        return self[2], self[3], self[4]
