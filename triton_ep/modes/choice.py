"""The modes of one Buffer, chosen once when it is built: normal mode within one host (:class:`Intranode`) or
across hosts (:class:`Internode`, over the group-wide :class:`Intranode`), and low-latency mode within one host or across hosts (:class:`LowLatency`,
with its network leg across hosts) or none (:class:`Unavailable`). Every mode takes the Buffer's calls with the
Buffer's own arguments, so the Buffer forwards each call with no branch (docs/design.md, section 2)."""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..runtime import Runtime
from ..runtime import ll_area_bytes
from .internode import Internode, LowLatencyAcrossHosts, traffic_stats
from .intranode import Intranode
from .low_latency import LowLatency, Unavailable

Tensor = torch.Tensor


@dataclass
class Modes:
    """The modes a Buffer chose (:func:`open_modes`), and what the Buffer asks of them together."""
    rt: Runtime                                     # the Buffer's runtime
    normal: Union[Intranode, Internode]             # get_dispatch_layout, dispatch, combine
    low_latency: Union[LowLatency, Unavailable]     # the low_latency_* calls
    internode: Optional[Internode]                  # across hosts: normal mode's network leg; else None
    num_rdma_bytes: int                             # the Buffer's num_rdma_bytes

    @property
    def intranode(self) -> Intranode:
        """The Buffer's group-wide :class:`Intranode` (across hosts, the one under the network leg)."""
        return self.internode.intranode if self.internode is not None else self.normal

    def check(self) -> None:
        """``Buffer.check``: within one host the runtime's records; across hosts also the RDMA proxies' and the
        capture path's statuses, and low-latency mode's own signals and proxy."""
        if self.internode is not None:
            self.internode.check()
            self.low_latency.check()
        else:
            self.rt.check()

    def close(self) -> None:
        """``Buffer.destroy``: low-latency mode's network leg, normal mode's, then the shared buffers. In a process
        forked from the one that built the Buffer nothing happens: the buffers, mappings, proxies and QPs are the
        parent's (releasing them from the child, whose threads did not survive the fork, unmapped memory that
        other objects still read: a segmentation fault across hosts)."""
        if os.getpid() != self.rt.pid:       # (the process that built the Buffer: Runtime.live)
            return
        try:
            if self.rt.comm is not None and self.rt.device.type == "cuda":
                # every stream's kernels first (the low-latency runtime across hosts has a stream of its own): the
                # modes drop their views of the shared buffers and rings as they close, and the rings are unmapped
                torch.cuda.synchronize(self.rt.device)
        finally:
            try:
                self.low_latency.close()
            finally:
                try:
                    if self.internode is not None:
                        self.internode.close()
                finally:
                    self.rt.close()

    def rdma_stats(self) -> dict:
        """``Buffer.get_rdma_stats``: normal mode's traffic between hosts, and low-latency mode's under
        ``"low_latency"`` where it has a network leg."""
        self.rt.live()
        stats = self.internode.stats() if self.internode is not None else traffic_stats()
        if self.low_latency.net is not None:
            stats["low_latency"] = traffic_stats(self.rt.rdma_transport, self.rt.num_hosts,
                                                 self.low_latency.net.sched.stats())
        return stats

    def local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                            use_rdma_buffer: bool) -> Tensor:
        """``Buffer.get_local_buffer_tensor``: a view of this rank's shared buffer, or with ``use_rdma_buffer``
        :meth:`rdma_scratch`.

        Raises:
            TypeError: ``dtype`` not a ``torch.dtype``.
            ValueError: ``offset`` not an int, negative or past the end (``numel`` of the buffer as ``dtype``), a
                ``size`` that is not a sequence of ints or has a negative dimension, or a ``size`` larger than
                what is left from ``offset``.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if use_rdma_buffer:
            return self.rdma_scratch(dtype, size, offset)
        data = self.rt.live().data.view(dtype)
        offset, shape = _view_args(offset, size, data.numel(), "the buffer")
        t = data[offset:]
        return t if shape is None else t[:shape.numel()].view(shape)

    def rdma_scratch(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int) -> Tensor:
        """What ``get_local_buffer_tensor(use_rdma_buffer=True)`` gives in place of DeepEP's NVSHMEM buffer: as many
        ``dtype`` elements as this rank's RDMA-side memory has from ``offset`` (across hosts the registered rings,
        else ``num_rdma_bytes``), all views of one scratch element (stride 0) that no call reads, so that writing
        it (vLLM zeroes it to reset it) changes nothing: the signal words carry call numbers."""
        self.rt.live()
        nbytes = self.internode.rdma_buffer().numel() if self.internode is not None else self.num_rdma_bytes
        offset, shape = _view_args(offset, size, nbytes // dtype.itemsize, "the RDMA buffer")
        shape = torch.Size([nbytes // dtype.itemsize - offset]) if shape is None else shape
        scratch = torch.zeros(1, dtype=dtype, device=self.rt.device)
        return scratch.as_strided(shape, (0,) * len(shape))


def _view_args(offset, size, numel: int, what: str):
    """``get_local_buffer_tensor``'s ``offset`` and ``size`` checked against ``numel`` elements of ``what``:
    ``(int offset, torch.Size or None)``. No Python-style negative indexing: DeepEP adds the offset to the buffer's
    pointer, so a negative one would point before the buffer.

    Raises:
        ValueError: ``offset`` not an int (a bool included; as every size argument), negative or past the end; a
            ``size`` that is not a sequence of ints (a float or bool dimension included), has a negative dimension,
            or has more elements than are left from ``offset`` (counted in Python ints: a product past int64, such as
            ``[2**62, 2**62]``, is too large, not torch's overflow); the message names the argument and value.
    """
    if not _is_int(offset):
        raise ValueError(f"offset must be an int, got {offset!r}")
    offset = operator.index(offset)
    if offset < 0 or offset > numel:
        raise ValueError(f"offset must be in [0, {numel}] (elements of {what} as this dtype), got {offset}")
    if size is None:
        return offset, None
    try:
        dims = tuple(size)
    except TypeError:
        dims = None
    if dims is None or not all(_is_int(d) for d in dims):
        raise ValueError(f"size must be a torch.Size or a sequence of ints, got {size!r}")
    dims = tuple(operator.index(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"size must have no negative dimension, got {dims}")
    if math.prod(dims) > numel - offset:
        raise ValueError(f"size {dims} exceeds {what} ({numel - offset} elements from offset {offset})")
    return offset, torch.Size(dims)


def _is_int(v) -> bool:
    """An int as a size argument takes it: a Python or numpy int, never a bool or a float."""
    return not isinstance(v, bool) and hasattr(v, "__index__")


def open_modes(rt: Runtime, low_latency_mode: bool, num_rdma_bytes: int, num_qps_per_rank: int, shrink: bool,
               allow_nvlink: bool) -> Modes:
    """Build a Buffer's modes over its runtime ``rt`` (the Buffer's arguments of the same names), then agree on
    the layout with every rank. On failure what was built is closed, ``rt`` too, and the error raised."""
    intranode = Intranode(rt)
    if rt.num_hosts == 1:
        ll = LowLatency(rt, rt.ll_offset, rt.ll_bytes, shrink) if rt.ll_bytes else Unavailable(rt)
        modes = Modes(rt, intranode, ll, None, num_rdma_bytes)
    else:
        modes = _open_across_hosts(rt, intranode, low_latency_mode, num_rdma_bytes, num_qps_per_rank, shrink,
                                   allow_nvlink)
    rt.agree_on_layout()
    return modes


def _open_across_hosts(rt: Runtime, intranode: Intranode, low_latency_mode: bool, num_rdma_bytes: int,
                       num_qps_per_rank: int, shrink: bool, allow_nvlink: bool) -> Modes:
    try:
        ll = (bool(low_latency_mode), int(num_rdma_bytes) if low_latency_mode else 0)
        internode = Internode(rt, intranode, low_latency=ll)
    except BaseException:
        rt.close()
        raise
    low_latency = Unavailable(rt)
    if low_latency_mode and num_rdma_bytes:
        try:
            low_latency = LowLatencyAcrossHosts(
                rt, ll_area_bytes(num_rdma_bytes), num_qps_per_rank, shrink, bool(allow_nvlink),
                delays=internode.delays)
        except BaseException:
            try:
                internode.close()
            finally:
                rt.close()
            raise
    return Modes(rt, internode, low_latency, internode, num_rdma_bytes)
