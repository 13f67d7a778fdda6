"""A null :class:`~triton_ep.transport.rdma.Transport`: ranks of one process joined by a :class:`NullWire`,
with completions delivered at once and (by default) no payload moved.  It times the RDMA proxy alone
(benchmarks/bench_scheduler.py): a real backend costs the posting thread the verbs calls, and the emulated
fabric copies payloads in the posting thread, so either would time itself too.

Semantics kept: WRITE_WITH_IMM produces a receive completion (``recv_imm``, with the immediate) at the
peer's QP of the same index, after the writes before it on that QP; a signalled request produces a send
completion.  WRITEs of at most ``small`` bytes (control words: credits, faults) are placed with a memory
copy; larger ones only when ``move_payload``.  FETCH_ADD is not supported (``RdmaError``).
"""
from __future__ import annotations

import collections
import ctypes
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from triton_ep.errors import EPTimeoutError
from triton_ep.transport.rdma import (WRITE, WRITE_WITH_IMM, Completion, Op, QPInfo, RdmaError, RemoteRegion,
                                      Transport)


class NullWire:
    """The ranks of one process that null transports connect (rank -> transport)."""

    def __init__(self) -> None:
        self.ends: Dict[int, "NullTransport"] = {}


class _Region:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr, self.addr, self.length, self.lkey, self.rkey = arr, arr.ctypes.data, arr.nbytes, 1, 1

    def view(self) -> np.ndarray:
        return self.arr

    def remote(self) -> RemoteRegion:
        return RemoteRegion(self.addr, self.length, (1,))


class NullTransport(Transport):
    """Rank ``rank`` of ``world_size`` on ``wire``; ``num_qps_per_peer`` QPs, all on one port.

    Args:
        move_payload: also copy WRITEs larger than ``small`` bytes (then it is a fast in-process transport).
        small: bytes up to which a WRITE is always placed (default 64).
    """

    def __init__(self, rank: int, world_size: int, wire: NullWire, *, num_qps_per_peer: int = 2,
                 timeout_s: float = 30.0, move_payload: bool = False, small: int = 64) -> None:
        self.rank, self.world_size, self.num_qps_per_peer, self.timeout_s = rank, world_size, num_qps_per_peer, timeout_s
        self.wire, self.move_payload, self.small = wire, move_payload, small
        self.auto_replenish = True
        self.q: collections.deque = collections.deque()
        self.lock = threading.Lock()
        wire.ends[rank] = self

    def register(self, nbytes_or_tensor: Any, *, remote_write: bool = True, remote_atomic: bool = True) -> _Region:
        """Host memory only: an int (allocated), a numpy array or a CPU tensor (registered in place)."""
        x = nbytes_or_tensor
        arr = np.zeros(x, np.uint8) if isinstance(x, int) else (x.numpy() if hasattr(x, "numpy") else x).view(np.uint8)
        return _Region(arr.reshape(-1))

    def local_info(self, peer: int) -> List[QPInfo]:
        return [QPInfo(i + 1, 0, "", 0, 0, 5, 1, "null") for i in range(self.num_qps_per_peer)]

    def connect(self, peer: int, remote: Sequence[QPInfo]) -> None:
        """Nothing to do: the wire already joins the ranks."""

    def post(self, peer: int, qp: int, ops: Sequence[Op]) -> List[int]:
        dst = self.wire.ends[peer]
        ids = []
        for op in ops:
            if op.kind not in (WRITE, WRITE_WITH_IMM):
                raise RdmaError(f"null transport: {op.kind} is not supported", peer=peer, qp_num=qp + 1)
            if op.length and (op.length <= self.small or self.move_payload):
                ctypes.memmove(op.remote.addr + op.remote_offset, op.region.addr + op.offset, op.length)
            if op.kind == WRITE_WITH_IMM:
                dst.q.append(Completion("IBV_WC_SUCCESS", "recv_imm", 0, op.imm, qp + 1, self.rank, qp, op.length))
            if op.signaled:
                self.q.append(Completion("IBV_WC_SUCCESS", op.kind, op.wr_id or 0, None, qp + 1, peer, qp, op.length))
            ids.append(op.wr_id or 0)
        return ids

    def post_recv(self, peer: int, qp: int, count: int) -> None:
        """Receives are unlimited here."""

    def poll(self, max_entries: int = 64, raise_on_error: bool = True) -> List[Completion]:
        out = []
        while self.q and len(out) < max_entries:
            out.append(self.q.popleft())
        return out

    def wait(self, predicate: Callable[[List[Completion]], bool], *, stage: str, peer: Optional[int] = None,
             timeout_s: Optional[float] = None, raise_on_error: bool = True) -> List[Completion]:
        import time
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline, got = time.monotonic() + t, []
        while not predicate(got):
            got += self.poll()
            if time.monotonic() > deadline:
                raise EPTimeoutError(self.rank, peer, stage, t)
        return got

    def close(self) -> None:
        self.wire.ends.pop(self.rank, None)


__all__ = ["NullTransport", "NullWire"]
