"""The pyverbs names of the emulated fabric (:mod:`triton_ep.transport.emulated`): the ``IBV_*`` constants, the
error classes, and the attribute and work-request classes (``GID``, ``AHAttr``, ``QPAttr``, ``SendWR``, ...), with
pyverbs' constructors and fields; plus the work queue entry and work completion the emulated HCA keeps."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple


# ----------------------------------------------------------------------------------------------- enums
class enums:  # noqa: N801  (named like the module it stands in for)
    """The ``IBV_*`` constants the verbs backend uses, with libibverbs' values (flat, as pyverbs <= 58)."""
    IBV_QPT_RC = 2
    IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE, IBV_QPS_ERR = range(7)
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_ATOMIC = 1, 2, 4, 8
    IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_ATOMIC_FETCH_AND_ADD = 0, 1, 6
    IBV_SEND_FENCE, IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_SEND_INLINE = 1, 2, 4, 8
    IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR = 0, 1, 2
    IBV_WC_LOC_PROT_ERR, IBV_WC_WR_FLUSH_ERR = 4, 5
    IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_OP_ERR = 9, 10, 11
    IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_GENERAL_ERR = 12, 13, 21
    IBV_WC_RDMA_WRITE, IBV_WC_FETCH_ADD, IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM = 1, 4, 128, 129
    IBV_WC_WITH_IMM = 2
    IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096 = 1, 2, 3, 4, 5
    IBV_PORT_DOWN, IBV_PORT_INIT, IBV_PORT_ACTIVE = 1, 2, 4
    IBV_LINK_LAYER_UNSPECIFIED, IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 0, 1, 2
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2 = 0, 1


E = enums


# ---------------------------------------------------------------------------------------------- errors
class PyverbsError(Exception):
    """Stand-in for ``pyverbs.pyverbs_error.PyverbsError``."""


class PyverbsUserError(PyverbsError):
    """Stand-in for ``PyverbsUserError``: a bad argument caught before any verbs call."""


class PyverbsRDMAError(PyverbsError):
    """Stand-in for ``PyverbsRDMAError``: a verbs call failed with ``error_code`` (an errno)."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        self.error_code = error_code
        if error_code > 0:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)


# ------------------------------------------------------------------------------------ attribute classes
class GID:
    """``ibv_gid`` as pyverbs shows it: ``.gid`` is 8 colon-separated groups of 4 hex digits."""

    def __init__(self, val: Optional[str] = None) -> None:
        self._gid = "0000:" * 7 + "0000"
        if val is not None:
            self.gid = val

    @property
    def gid(self) -> str:
        """The GID as 8 colon-separated groups of 4 lowercase hex digits."""
        return self._gid

    @gid.setter
    def gid(self, val: str) -> None:
        """Set from 8 colon-separated hex groups (pyverbs rejects other forms with PyverbsUserError)."""
        parts = val.split(":")
        if len(parts) != 8 or not all(len(p) <= 4 and all(c in "0123456789abcdefABCDEF" for c in p) for p in parts):
            raise PyverbsUserError(f"Invalid GID value ({parts})")
        self._gid = ":".join(p.lower().zfill(4) for p in parts)

    def __str__(self) -> str:
        return self._gid


class GlobalRoute:
    """``ibv_global_route``: destination GID, 20-bit flow label, source GID index, hop limit, class."""

    def __init__(self, dgid: Optional[GID] = None, flow_label: int = 0, sgid_index: int = 0,
                 hop_limit: int = 1, traffic_class: int = 0) -> None:
        self.dgid = str(dgid or GID())   # pyverbs returns the GID as its string
        self.flow_label, self.sgid_index = flow_label, sgid_index
        self.hop_limit, self.traffic_class = hop_limit, traffic_class


class AHAttr:
    """``ibv_ah_attr``: LID, SL, port and, when ``is_global``, the GRH fields flattened as pyverbs does."""

    def __init__(self, dlid: int = 0, sl: int = 0, src_path_bits: int = 0, static_rate: int = 0,
                 is_global: int = 0, port_num: int = 1, gr: Optional[GlobalRoute] = None) -> None:
        self.dlid, self.sl, self.src_path_bits, self.static_rate = dlid, sl, src_path_bits, static_rate
        self.is_global, self.port_num = is_global, port_num
        gr = gr or GlobalRoute()
        self.dgid, self.flow_label, self.sgid_index = gr.dgid, gr.flow_label, gr.sgid_index
        self.hop_limit, self.traffic_class = gr.hop_limit, gr.traffic_class


class QPCap:
    """``ibv_qp_cap``: send/receive queue depths and SGE limits."""

    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1,
                 max_recv_sge: int = 1, max_inline_data: int = 0) -> None:
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge, self.max_inline_data = max_send_sge, max_recv_sge, max_inline_data


class QPInitAttr:
    """``ibv_qp_init_attr``: QP type, send and receive CQs, capabilities, ``sq_sig_all``."""

    def __init__(self, qp_type: int = E.IBV_QPT_RC, qp_context=None, scq=None, rcq=None, srq=None,
                 cap: Optional[QPCap] = None, sq_sig_all: int = 0) -> None:
        self.qp_type, self.send_cq, self.recv_cq, self.srq = qp_type, scq, rcq, srq
        self.cap, self.sq_sig_all = cap or QPCap(), sq_sig_all
        for k in ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data"):
            setattr(self, k, getattr(self.cap, k))


class QPAttr:
    """``ibv_qp_attr`` with pyverbs' reset-to-init defaults; set fields as attributes."""

    def __init__(self, qp_state: int = E.IBV_QPS_INIT, cur_qp_state: int = E.IBV_QPS_RESET) -> None:
        self.qp_state, self.cur_qp_state = qp_state, cur_qp_state
        self.port_num, self.pkey_index, self.qp_access_flags = 1, 0, 0
        self.path_mtu, self.dest_qp_num, self.rq_psn, self.sq_psn = E.IBV_MTU_1024, 0, 0, 0
        self.max_dest_rd_atomic, self.max_rd_atomic, self.min_rnr_timer = 0, 0, 0
        self.timeout, self.retry_cnt, self.rnr_retry = 0, 0, 0
        self.ah_attr: Optional[AHAttr] = None


class SGE:
    """``ibv_sge``: address, length (bytes) and lkey of local memory."""

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    """``ibv_send_wr``: id, opcode, SGEs, immediate, flags; ``set_wr_rdma`` / ``set_wr_atomic``; ``next_wr``.

    As in pyverbs, the constructor copies the SGEs given (a later change of those SGE objects does not show),
    ``sg_list`` may only be set, to one :class:`SGE` whose fields the request then reads at each post (how a
    request built once is reused with a new length), and ``next_wr`` may only be set to another request (never
    back to ``None``: a chain ends at a request that was never linked)."""

    def __init__(self, wr_id: int = 0, opcode: int = E.IBV_WR_RDMA_WRITE, num_sge: int = 1, imm_data: int = 0,
                 sg=None, send_flags: int = E.IBV_SEND_SIGNALED) -> None:
        if not sg or num_sge < 1:
            raise PyverbsUserError("A WR needs at least one SGE")
        self.wr_id, self.opcode, self.num_sge, self.imm_data = wr_id, opcode, num_sge, imm_data
        self._sg = [SGE(s.addr, s.length, s.lkey) for s in list(sg)[:num_sge]]
        self.send_flags, self._next = send_flags, None
        self.rkey = self.remote_addr = self.compare_add = self.swap = 0

    @property
    def sg_list(self) -> List[SGE]:
        """The SGEs the request reads when posted (the emulator's view; pyverbs has no getter)."""
        return self._sg

    @sg_list.setter
    def sg_list(self, sge: SGE) -> None:
        if not isinstance(sge, SGE):
            raise TypeError(f"sg_list must be set to an SGE, got {type(sge).__name__}")
        self._sg = [sge]

    @property
    def next_wr(self) -> Optional["SendWR"]:
        """The next request of the chain (``None`` at its end)."""
        return self._next

    @next_wr.setter
    def next_wr(self, wr: "SendWR") -> None:
        if not isinstance(wr, SendWR):
            raise TypeError(f"next_wr must be set to a SendWR, got {type(wr).__name__}")
        self._next = wr

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        """Target of an RDMA WRITE: remote key and address."""
        self.rkey, self.remote_addr = rkey, addr

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        """Target and operands of an atomic; for FETCH_AND_ADD ``compare_add`` is the addend."""
        self.rkey, self.remote_addr, self.compare_add, self.swap = rkey, addr, compare_add, swap


class RecvWR:
    """``ibv_recv_wr``: id and SGEs (pyverbs requires at least one)."""

    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg=None, next_wr=None) -> None:
        if not sg or num_sge < 1:
            raise PyverbsUserError("A WR needs at least one SGE")
        self.wr_id, self.num_sge, self.sg_list, self.next_wr = wr_id, num_sge, list(sg), next_wr


@dataclass(slots=True)
class _WQE:
    """A posted send request as the emulated HCA keeps it until it executes it (a work queue entry): the request's
    number on its QP, id, opcode, whether it is signalled, immediate, remote key and address, FETCH_ADD's addend, and
    its SGEs as ``(addr, length, lkey)``, copied at post time (the caller may reuse the request and its SGEs)."""
    seq: int
    wr_id: int
    opcode: int
    signaled: bool
    imm: int
    rkey: int
    remote_addr: int
    compare_add: int
    sges: tuple


class WC:
    """``ibv_wc``: status, opcode, wr_id, imm_data, qp_num, byte_len, wc_flags."""

    def __init__(self, wr_id: int, status: int, opcode: int, qp_num: int, byte_len: int = 0,
                 imm_data: int = 0, wc_flags: int = 0) -> None:
        self.wr_id, self.status, self.opcode, self.qp_num = wr_id, status, opcode, qp_num
        self.byte_len, self.imm_data, self.wc_flags = byte_len, imm_data, wc_flags
        self.vendor_err, self.src_qp = 0, 0
        self._retire: Optional[Tuple["QP", int]] = None
