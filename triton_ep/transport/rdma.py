"""The transport interface for RDMA-style peers: what the internode mode and the scheduler program against.

One implementation exists, :class:`triton_ep.transport.verbs.VerbsTransport`; it drives real pyverbs or the
emulated fabric (:mod:`triton_ep.transport.emulated`), which offers the same class and method names.

Semantics are those of the InfiniBand verbs spec for reliable-connected (RC) queue pairs, as exposed by
rdma-core's libibverbs and its Python binding pyverbs:

* work requests on one QP are executed and placed in order; there is no order across QPs;
* a send completion means the data is placed at the responder (RC acknowledges after placement);
* RDMA WRITE_WITH_IMM consumes one posted receive at the responder and completes it with the immediate;
* an unsignalled work request produces no completion; its send-queue slot is freed when a later
  signalled request on the same QP is polled;
* an error completion moves the QP to the error state; later requests complete with "flushed".

Every wait here has a timeout that raises :class:`triton_ep.errors.EPTimeoutError`; every failure is an
:class:`RdmaError` naming the device, port, QP number and peer.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from triton_ep.errors import EPError
from triton_ep.transport import topology

#: Work request kinds accepted by :meth:`Transport.post`.
WRITE = "write"
WRITE_WITH_IMM = "write_imm"
FETCH_ADD = "fetch_add"
OP_KINDS = (WRITE, WRITE_WITH_IMM, FETCH_ADD)


class RdmaError(EPError):
    """An RDMA operation failed.  Names where: device, port, QP number and peer rank (each may be None).

    Attributes:
        device, port, qp_num, peer: location of the failure.
        status: the work completion status name (``"IBV_WC_REM_ACCESS_ERR"``) for completion errors.
        errno: the OS error number for failed verbs calls, where known.
    """

    def __init__(self, msg: str, *, device: Optional[str] = None, port: Optional[int] = None,
                 qp_num: Optional[int] = None, peer: Optional[int] = None, status: Optional[str] = None,
                 errno: Optional[int] = None) -> None:
        self.device, self.port, self.qp_num, self.peer = device, port, qp_num, peer
        self.status, self.errno = status, errno
        where = " ".join(f"{k} {v}" for k, v in (("device", device), ("port", port), ("QP", qp_num),
                                                  ("peer", peer)) if v is not None)
        super().__init__(f"triton-ep RDMA: {msg}" + (f" ({where})" if where else ""))


class RdmaUnavailable(RdmaError):
    """No usable RDMA stack: pyverbs does not import, or no RDMA device exists on this host."""


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory region, as the writer needs it: base address, length and rkeys.

    ``addr`` is the address in the owner's address space (what RDMA WRITE targets); ``length`` in bytes.
    ``rkeys[d]`` is the key for the owner's device slot ``d`` (a region is registered once per device the
    owner opened, each with its own protection domain); ``rkey`` is ``rkeys[0]``.
    """
    addr: int
    length: int
    rkeys: tuple

    @property
    def rkey(self) -> int:
        """The rkey of the owner's first device."""
        return self.rkeys[0]


@dataclass(frozen=True)
class QPInfo:
    """Connection info of one RC queue pair, exchanged between peers before RTR.

    Attributes:
        qp_num: 24-bit QP number.  psn: initial packet sequence number (24 bits).
        gid: GID of the sending port (8 hex groups; all zero on InfiniBand without GRH).
        gid_index: its index in the port's GID table.  lid: the port's LID (InfiniBand; 0 on RoCE).
        mtu: path MTU as the ``IBV_MTU_*`` enum value (1=256 ... 5=4096).
        port: the 1-based local port.  device: the device name (for error messages and the table).
        dev_slot: index of that device among the owner's opened devices (selects the rkey to use).
    """
    qp_num: int
    psn: int
    gid: str
    gid_index: int
    lid: int
    mtu: int
    port: int
    device: str
    dev_slot: int = 0


@dataclass
class Op:
    """One work request for :meth:`Transport.post`.

    Attributes:
        kind: :data:`WRITE`, :data:`WRITE_WITH_IMM` or :data:`FETCH_ADD`.
        region: handle of a local registered region (from :meth:`Transport.register`).
        offset: byte offset of the source (or, for FETCH_ADD, of the 8-byte result slot) in ``region``.
        length: bytes to write (FETCH_ADD: must be 8).
        remote: the target region; ``remote_offset`` is added to its address.
        imm: 32-bit immediate for WRITE_WITH_IMM (passed through unchanged, as pyverbs does).
        add: the 64-bit addend for FETCH_ADD (the remote 8 bytes are an unsigned little-endian integer).
        signaled: request a completion.  The transport may add signals to keep the send queue from filling.
        wr_id: 64-bit id returned in the completion (None: the transport numbers it).
    """
    kind: str
    region: Any
    offset: int
    length: int
    remote: RemoteRegion
    remote_offset: int = 0
    imm: int = 0
    add: int = 0
    signaled: bool = False
    wr_id: Optional[int] = None


@dataclass(slots=True)      # (a proxy makes one per reported work completion: slots build and read faster)
class Completion:
    """One work completion.

    Attributes:
        status: the ``IBV_WC_*`` status name (``"IBV_WC_SUCCESS"`` when fine).  ok: status is success.
        opcode: ``"write"``, ``"write_imm"``, ``"fetch_add"`` (send side) or ``"recv_imm"`` (receive side).
        wr_id: the request's id (receive side: the transport's own id of the consumed receive).
        imm: the immediate (receive side of WRITE_WITH_IMM), else None.
        qp_num: local QP number.  peer: peer rank of that QP.  qp: the QP's index among the peer's QPs.
        byte_len: bytes (receive side: length of the write).
    """
    status: str
    opcode: str
    wr_id: int
    imm: Optional[int]
    qp_num: int
    peer: Optional[int]
    qp: Optional[int]
    byte_len: int = 0

    @property
    def ok(self) -> bool:
        """True when the completion's status is success."""
        return self.status == "IBV_WC_SUCCESS"


class Transport(abc.ABC):
    """RDMA-style point-to-point transport between the ranks of a group.

    Life cycle: construct (opens devices, creates PD, CQs and ``num_qps_per_peer`` RC QPs per peer) ->
    :meth:`local_info` / :func:`exchange_info` -> :meth:`connect` -> register, post, poll -> :meth:`close`.
    """

    rank: int
    world_size: int
    num_qps_per_peer: int
    #: bound in seconds of every wait (send-queue space, :meth:`wait`)
    timeout_s: float = 30.0
    #: the ranks it has QPs to (``None``: every other rank of the group)
    peers: Optional[List[int]] = None

    def peer_ranks(self) -> List[int]:
        """The ranks this transport has QPs to, ascending."""
        return list(self.peers) if self.peers is not None else [p for p in range(self.world_size) if p != self.rank]

    @abc.abstractmethod
    def register(self, nbytes_or_tensor: Any, *, remote_write: bool = True, remote_atomic: bool = True) -> Any:
        """Register memory: an int allocates that many bytes; a tensor/array is registered in place.

        Returns a region handle with ``.addr``, ``.length``, ``.rkey``, ``.lkey``, ``.view()``
        (a uint8 numpy view where the memory is host memory) and ``.remote()`` (a :class:`RemoteRegion`).
        Raises :class:`RdmaError` naming the device on failure.
        """

    @abc.abstractmethod
    def local_info(self, peer: int) -> List[QPInfo]:
        """Connection info of this rank's QPs towards ``peer`` (one per QP, in QP index order)."""

    @abc.abstractmethod
    def connect(self, peer: int, remote: Sequence[QPInfo]) -> None:
        """Move this rank's QPs towards ``peer`` INIT -> RTR -> RTS against the peer's ``remote`` infos.

        Raises :class:`RdmaError` naming device, port, QP and peer on a failed transition.
        """

    @abc.abstractmethod
    def post(self, peer: int, qp: int, ops: Sequence[Op]) -> List[int]:
        """Post ``ops``, in order, on QP ``qp`` of ``peer`` as chained batches; returns their wr_ids.

        Blocks (polling, bounded by the transport's timeout) while the send queue is full; completions
        polled meanwhile are kept for :meth:`poll`.
        Raises :class:`RdmaError` if the verbs call fails, ``EPTimeoutError`` if the queue never drains.
        """

    def prepare(self, peer: int, qp: int, key: Hashable, op: Op) -> None:
        """Keep ``op`` (a WRITE or WRITE_WITH_IMM) as a work request of QP ``qp`` of ``peer`` under ``key``, built
        once, for :meth:`post_prepared` to post again and again with only its length, immediate, ``wr_id`` and
        completion request changed (the scheduler prepares one per ring slot and QP at start). Preparing a key
        again replaces it. This default keeps the ``Op`` and posts copies of it through :meth:`post`; the verbs
        backend keeps the built ``SendWR`` and its ``SGE``.

        Raises :class:`RdmaError` (an unknown kind; the verbs backend: a QP not connected).
        """
        if op.kind not in (WRITE, WRITE_WITH_IMM):
            raise RdmaError(f"prepare: only WRITE and WRITE_WITH_IMM are prepared, got {op.kind!r}", peer=peer)
        self.__dict__.setdefault("_prepared_ops", {})[(peer, qp, key)] = op

    def post_prepared(self, peer: int, qp: int, reqs: Sequence[Tuple[Hashable, int, int, Optional[int], bool]]
                      ) -> None:
        """Post, in order on QP ``qp`` of ``peer``, the prepared work requests ``reqs``: ``(key, length, imm,
        wr_id, signaled)`` each (``length`` bytes from the prepared source; ``imm`` for a WRITE_WITH_IMM; ``wr_id``
        None: the transport numbers it), as :meth:`post` posts ``Op``s (one chain per call where the send queue
        has room; the same completions). ``reqs`` may name a key more than once.

        Raises: as :meth:`post`; ``KeyError`` for a key never prepared on that QP.
        """
        ops = self.__dict__.get("_prepared_ops", {})
        out = []
        for key, length, imm, wr_id, signaled in reqs:
            o = ops[(peer, qp, key)]
            out.append(Op(o.kind, o.region, o.offset, length, o.remote, o.remote_offset, imm, 0, signaled, wr_id))
        self.post(peer, qp, out)

    @abc.abstractmethod
    def post_recv(self, peer: int, qp: int, count: int) -> None:
        """Post ``count`` zero-length receives (for WRITE_WITH_IMM) on QP ``qp`` of ``peer``."""

    @abc.abstractmethod
    def poll(self, max_entries: int = 64, raise_on_error: bool = True) -> List[Completion]:
        """Poll every CQ once without waiting; returns up to ``max_entries`` completions per CQ.

        Receives are replenished automatically when ``auto_replenish`` is set.  With ``raise_on_error`` a
        failed completion raises :class:`RdmaCompletionError` (the other completions of that poll are
        kept in ``.completions``).
        """

    @abc.abstractmethod
    def wait(self, predicate: Callable[[List[Completion]], bool], *, stage: str, peer: Optional[int] = None,
             timeout_s: Optional[float] = None, raise_on_error: bool = True) -> List[Completion]:
        """Poll until ``predicate(all completions so far)`` is true; returns them.

        Raises ``EPTimeoutError(rank, peer, stage, timeout_s)`` when the bound (default ``timeout_s``) passes
        first, and :class:`RdmaCompletionError` on a failed completion when ``raise_on_error``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy QPs, CQs, MRs, PD and close the devices (idempotent)."""

    def placement(self, peer: int) -> List[Any]:
        """Where each QP towards ``peer`` sends from: one ``topology.QPPlanEntry`` per QP index (port, flow
        label, UDP source port), as the topology plan placed it at :meth:`connect`.  The default (a
        transport with no ports) puts every QP on one nameless port."""
        return [topology.QPPlanEntry(i, topology.PortRef("none", 1)) for i in range(self.num_qps_per_peer)]


class RdmaCompletionError(RdmaError):
    """A work completion with an error status.  ``.completion`` is it; ``.completions`` all of that poll."""

    def __init__(self, msg: str, completion: Completion, completions: List[Completion], **where: Any) -> None:
        self.completion, self.completions = completion, completions
        super().__init__(msg, status=completion.status, **where)


#: the stage :func:`exchange_info` names in its errors
QP_INFO_STAGE = "rdma: exchange QP info"


def exchange_info(local: Dict[int, List[QPInfo]], group: Any = None,
                  timeout_s: float = 100.0, exchange: Any = None) -> Dict[int, List[QPInfo]]:
    """Swap connection info with every peer through the group's store (a bounded exchange that leaves
    nothing pending: :mod:`triton_ep.transport.bootstrap`).

    Args:
        local: peer rank -> this rank's QP infos towards that peer.
        group: process group (None: the default group).  Must be initialised.
        timeout_s: bound in seconds on the wait for every rank.
        exchange: a :class:`triton_ep.transport.bootstrap.Exchange` made earlier for this step (so that a rank that
            fails before it can tell its peers through it), or None (one is made here).
    Returns:
        peer rank -> that peer's QP infos towards this rank.
    Raises:
        EPTimeoutError: ranks did not arrive in time (named); EPRemoteError: a peer gave up first.
    """
    import torch.distributed as dist
    group = group if group is not None else dist.group.WORLD
    me = group.rank()
    from triton_ep.transport.bootstrap import Exchange   # (torch: not in the proxy process)
    gathered = (exchange or Exchange(group, timeout_s, QP_INFO_STAGE)).gather(local)
    return {p: gathered[p][me] for p in range(len(gathered)) if p != me and me in gathered[p]}


def exchange_regions(region: RemoteRegion, group: Any = None, timeout_s: float = 100.0) -> List[RemoteRegion]:
    """All ranks' :class:`RemoteRegion` of one buffer (index = rank), through the group's store (bounded, as
    :func:`exchange_info`)."""
    import torch.distributed as dist
    group = group if group is not None else dist.group.WORLD
    from triton_ep.transport.bootstrap import gather_objects
    return gather_objects(group, region, timeout_s, "rdma: exchange memory regions")


__all__ = ["WRITE", "WRITE_WITH_IMM", "FETCH_ADD", "RdmaError", "RdmaUnavailable", "RdmaCompletionError",
           "RemoteRegion", "QPInfo", "Op", "Completion", "Transport", "exchange_info", "exchange_regions"]
