"""The network leg's records as internode normal mode sizes and reads them (both paths): a record's bytes
(:class:`~triton_ep.protocol.records.NetRecord`), the streams a rank sends each host, and the fields of received
records. The kernels' view of the rows a record carries is :meth:`triton_ep.kernels.net.Sources.of_rows`."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ...protocol.records import NET_META_BYTES, NetRecord

Tensor = torch.Tensor


#: records as the network leg's receivers hold them: uint8 ``[..., nbytes]`` (``[n, nbytes]``, or the capture path's
#: staging areas ``[num_hosts, room, nbytes]`` as a strided view), or a list of such blocks, one after another
Records = Union[Tensor, Sequence[Tensor]]


def byte_columns(rows: Records, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """Bytes ``[lo, hi)`` of each record of ``rows`` (:data:`Records`), in order, as ``dtype`` ``[n, (hi - lo) /
    size]``, in fresh memory (a slice of one row keeps its offset, which a wider dtype's view may not take): one copy
    per block, with no copy of the records themselves (a strided view of staging areas is read as it is)."""
    blocks = [rows] if isinstance(rows, Tensor) else list(rows)
    n = sum(b.numel() // b.shape[-1] for b in blocks)
    out = torch.empty((n, hi - lo), dtype=torch.uint8, device=blocks[0].device)
    at = 0
    for b in blocks:
        k = b.numel() // b.shape[-1]
        out[at:at + k].view(*b.shape[:-1], hi - lo).copy_(b[..., lo:hi])
        at += k
    return out.view(dtype)


def record_field(rec: NetRecord, rows: Records, field: str, dtype: torch.dtype) -> Tensor:
    """``field`` of the records ``rows`` (:data:`Records`, ``n`` of them) as ``dtype`` ``[n, ...]``, in fresh
    memory."""
    return byte_columns(rows, *rec.span(field), dtype)


def row_sums(rec: NetRecord, rows: Tensor, hidden: int) -> Tensor:
    """The bf16 partial sums of combine records ``rows`` (uint8 ``[n, rec.nbytes]``, a strided view included) as
    fp32 ``[n, hidden]``: one conversion read straight from the records through a bf16 view (records of
    :func:`network_record_bytes` are 16-byte aligned, their row field too, so the view always exists)."""
    lo, hi = rec.span("row")
    return rows[:, lo:hi].view(torch.bfloat16)[:, :hidden].float()


def record_meta(recv_xf: Tensor) -> Tensor:
    """The meta blocks of received records (uint8 ``[N, 16 + row]``) as int32 ``[N, 4]`` (source rank,
    source token, 0, 0)."""
    return byte_columns(recv_xf, 0, NET_META_BYTES, torch.int32)


def x_rows(recv_xf: Tensor, dtype, hidden: int, order: Tensor) -> Tensor:
    """The x rows of received records (uint8 ``[N, 16 + row]``) taken in ``order`` (int64 ``[N]``, a
    permutation) as ``dtype`` ``[N, hidden]``, in fresh memory: one gather of the rows' bytes, with no
    intermediate copy (a call of DeepEP's test shape moves hundreds of MB here)."""
    return recv_xf[:, NET_META_BYTES:].index_select(0, order).view(dtype)


def network_record_bytes(row_bytes: int, scale_bytes: int, num_topk: int, weights: bool, ranks_per_host: int) -> int:
    """Bytes of one network-leg dispatch record (16-byte aligned): meta, an x row of ``row_bytes``, its
    ``scale_bytes``, ``num_topk`` int64 ids (and fp32 weights with ``weights``), and ``ranks_per_host`` bytes of
    ``is_token_in_rank``. A combine record is ``network_record_bytes(2 * hidden + 4 * num_topk, 0, 0, False, 0)``
    (the partial sum in bf16, then the weights' fp32 sums)."""
    return NetRecord(row_bytes, scale_bytes, num_topk, num_topk if weights else 0, ranks_per_host).nbytes


@dataclasses.dataclass
class Streams:
    """What a rank sends each host in one host-path exchange: a record stream per host (its own host's included,
    which stays on this rank), as its headers tell it; the network-leg kernels build the records from sources the
    caller gives them (:meth:`~.rings.Rings.exchange`)."""
    rec: NetRecord                  # the records' layout
    tokens: List[Tensor]            # per host: int64 [n_h] rows of the sources, in stream order, on the device
    #: a dispatch without topk_idx: num_tokens_per_expert (int32 [E]); each host's slice goes to the RDMA peer
    #: there, which forwards the sums (the forwarding leg's per-expert counts)
    npe: Optional[Tensor] = None
    #: this rank's call as its RDMA peers compare it: ``(call-card code, value, ...)``
    #: (:mod:`triton_ep.protocol.call_card`; ``()``: none to compare)
    card: tuple = ()

    def count(self, host: int) -> int:
        return self.tokens[host].numel()


@dataclasses.dataclass
class Forwarded:
    """Received records as the forwarding leg's intranode dispatch takes them (``F`` rows, on the device)."""
    x: Tensor                       # uint8 [F, 16 + row]: meta, then the row's bytes
    scales: Optional[Tensor]        # [F, S] as the sender's scales' dtype, or None
    ids: Optional[Tensor]           # int64 [F, K] global expert ids, or None (a cached dispatch; no topk_idx)
    weights: Optional[Tensor]       # fp32 [F, K], or None
    in_rank: Optional[Tensor]       # bool [F, per_host]: is_token_in_rank of this host's ranks, or None (cached)

    @property
    def xs(self) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """``x``, or ``(x, scales)`` where the records carry scales (the intranode dispatch's ``x``)."""
        return self.x if self.scales is None else (self.x, self.scales)

    def release(self) -> None:
        """Drop every field (``None``) once the forwarding leg's intranode dispatch took them: they are freed
        before its received rows are gathered in DeepEP's order, which needs memory of their size again."""
        self.x = self.scales = self.ids = self.weights = self.in_rank = None


def split_records(fwd: Records, rec: NetRecord, sc_dtype, dev) -> Forwarded:
    """The records ``fwd`` (:data:`Records`, ``F`` of them) as the intranode dispatch takes them, on ``dev``
    (``sc_dtype``: the scales' dtype, where ``rec`` has scales): each field copied once out of the records."""
    x_f = byte_columns(fwd, 0, rec.span("row")[1], torch.uint8).to(dev)        # meta, then the row
    sc_f = record_field(rec, fwd, "scales", sc_dtype).to(dev) if rec.scales else None
    ids = record_field(rec, fwd, "ids", torch.int64).to(dev) if rec.ids else None
    w = record_field(rec, fwd, "weights", torch.float32).to(dev) if rec.weights else None
    in_f = record_field(rec, fwd, "local", torch.bool).to(dev) if rec.local else None
    return Forwarded(x_f, sc_f, ids, w, in_f)
