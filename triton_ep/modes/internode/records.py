"""The network leg's records as internode normal mode builds and reads them (both paths): a call's record layout
(:class:`~triton_ep.protocol.records.NetRecord`), the kernels' view of its source rows, the streams a rank sends
each host, and the fields of received records."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple, Union

import torch

from ...kernels import net
from ...protocol.records import NET_META_BYTES, NetRecord

Tensor = torch.Tensor


def dense(t: Tensor) -> Tensor:
    """``t`` with row-major strides, a view where it has them. ``Tensor.contiguous()`` is not enough before a dtype
    view: a size-1 dimension may keep any stride (a column-major ``[n, 1]`` scale tensor, a single row), and
    ``view(dtype)`` of another element size needs the last stride to be 1."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def words(t: Optional[Tensor], n: int, dev) -> Tensor:
    """``t`` (``[n, ...]``, any strides) as int32 ``[n, words]``; a one-word dummy for ``None``."""
    if t is None:
        return torch.zeros(1, dtype=torch.int32, device=dev)
    return dense(t).view(torch.uint8).view(n, t.element_size() * math.prod(t.shape[1:])).view(torch.int32)


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


def x_rows(recv_xf: Tensor, dtype, hidden: int) -> Tensor:
    """The x rows of received records (uint8 ``[N, 16 + row]``) as ``dtype`` ``[N, hidden]``."""
    return byte_columns(recv_xf, NET_META_BYTES, recv_xf.shape[1], dtype)


def record_layout(xv: Tensor, sc: Optional[Tensor], ids: int = 0, weights: int = 0, local: int = 0) -> NetRecord:
    """The record layout of a dispatch of rows ``xv`` with scales ``sc`` (fp32 / int32 ``[T, S]`` or
    ``None``); a cached dispatch carries no ids, weights or is_token_in_rank bytes."""
    return NetRecord(xv.shape[1] * xv.element_size(), 0 if sc is None else sc.shape[1] * 4, ids, weights, local)


def network_record_bytes(row_bytes: int, scale_bytes: int, num_topk: int, weights: bool, ranks_per_host: int) -> int:
    """Bytes of one network-leg dispatch record (16-byte aligned): meta, an x row of ``row_bytes``, its
    ``scale_bytes``, ``num_topk`` int64 ids (and fp32 weights with ``weights``), and ``ranks_per_host`` bytes of
    ``is_token_in_rank``. A combine record is ``network_record_bytes(2 * hidden + 4 * num_topk, 0, 0, False, 0)``
    (the partial sum in bf16, then the weights' fp32 sums)."""
    return NetRecord(row_bytes, scale_bytes, num_topk, num_topk if weights else 0, ranks_per_host).nbytes


def sources(rec: NetRecord, n: int, x: Tensor, cols: Tensor, rank: int, dev, sc: Optional[Tensor] = None,
            ids: Optional[Tensor] = None, w: Optional[Tensor] = None,
            in_rank: Optional[Tensor] = None) -> net.Sources:
    """The network-leg kernels' view of ``n`` source rows: ``x`` (``[n, ...]``, ``rec.row`` bytes a row),
    scales, int64 ids, fp32 weights and bool ``is_token_in_rank`` ``[n, R]`` (each ``None`` where ``rec``
    has no such field); ``cols``: int32 ``[num_hosts, per_host]``, the global rank of each host's local ranks;
    ``rank``: this rank; ``dev``: the device."""
    loc = torch.zeros(1, dtype=torch.uint8, device=dev) if in_rank is None else \
        in_rank.contiguous().view(torch.uint8)
    return net.Sources.of(rec, words(x, n, dev), words(sc, n, dev), words(ids, n, dev), words(w, n, dev), loc,
                          0 if in_rank is None else in_rank.shape[1], cols, rank)


@dataclasses.dataclass
class Streams:
    """What a rank sends each host in one host-path exchange: a record stream per host (its own host's included,
    which stays on this rank), built by the network-leg kernels from ``src``."""
    rec: NetRecord                  # the records' layout
    src: net.Sources                # the kernels' view of the source rows
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


def split_records(fwd: Tensor, rec: NetRecord, sc_dtype, dev) -> Forwarded:
    """The records ``fwd`` (uint8 ``[F, rec.nbytes]``) as the intranode dispatch takes them, on ``dev``
    (``sc_dtype``: the scales' dtype, where ``rec`` has scales)."""
    x_f = byte_columns(fwd, 0, rec.span("row")[1], torch.uint8).to(dev)        # meta, then the row
    sc_f = record_field(rec, fwd, "scales", sc_dtype).to(dev) if rec.scales else None
    ids = record_field(rec, fwd, "ids", torch.int64).to(dev) if rec.ids else None
    w = record_field(rec, fwd, "weights", torch.float32).to(dev) if rec.weights else None
    in_f = record_field(rec, fwd, "local", torch.bool).to(dev) if rec.local else None
    return Forwarded(x_f, sc_f, ids, w, in_f)
