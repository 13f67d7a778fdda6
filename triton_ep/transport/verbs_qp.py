"""What the verbs backend (:mod:`triton_ep.transport.verbs`) builds its queue pairs and requests from: the QoS
every QP's address carries (:class:`QoS`), a QP's init attributes, the one ``QPAttr`` its INIT, RTR and RTS
transitions read, and send work requests of each kind."""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Tuple

from triton_ep.transport import topology
from triton_ep.transport.rdma import FETCH_ADD, WRITE_WITH_IMM, QPInfo
from triton_ep.transport.verbs_api import enums_of


#: The environment variables that set the QoS defaults, and the range of each value.
QOS_ENV = {"traffic_class": ("TRITON_EP_RDMA_TC", 255), "service_level": ("TRITON_EP_RDMA_SL", 15)}


def _qos_value(name: str, value: Optional[int], env: Mapping[str, str]) -> Tuple[int, str]:
    """(value, where it came from) of one QoS setting: the argument, else its variable, else 0."""
    var, hi = QOS_ENV[name]
    if value is not None:
        try:
            v = operator.index(value)
        except TypeError:
            v = -1
        if isinstance(value, bool) or not 0 <= v <= hi:
            raise ValueError(f"{name} must be an integer in 0..{hi}, got {value!r}")
        return v, "argument"
    text = env.get(var, "").strip()
    if not text:
        return 0, "default"
    try:
        v = int(text, 0)
    except ValueError:
        v = -1
    if not 0 <= v <= hi:
        raise ValueError(f"{var}={text!r}: the RDMA {name.replace('_', ' ')} must be an integer in 0..{hi}")
    return v, var


@dataclass(frozen=True)
class QoS:
    """The QoS fields every QP's address carries (``ibv_ah_attr``, set at RTR).

    Attributes:
        traffic_class: ``ibv_global_route.traffic_class`` (0..255): the GRH traffic class, on RoCEv2 the IP
            header's TOS / traffic-class byte (DSCP in the upper 6 bits, ECN in the lower 2), as switches see it
            for PFC/ECN classification (NCCL's ``NCCL_IB_TC``).
        service_level: ``ibv_ah_attr.sl`` (0..15): the InfiniBand service level (mapped to a virtual lane by the
            subnet manager); on RoCE the kernel maps it to the VLAN priority (PCP) where a VLAN is used.
        sources: where each came from: ``"argument"``, the environment variable's name, or ``"default"``.
    Semantics: the verbs spec's address vector (IBTA vol. 1, 11.2.5 / 9.6.1) as ``ibv_modify_qp(3)`` takes it.
    """
    traffic_class: int = 0
    service_level: int = 0
    sources: Tuple[str, str] = ("default", "default")

    @classmethod
    def resolve(cls, traffic_class: Optional[int] = None, service_level: Optional[int] = None,
                env: Optional[Mapping[str, str]] = None) -> "QoS":
        """The effective settings: each argument when given, else ``TRITON_EP_RDMA_TC`` / ``TRITON_EP_RDMA_SL``
        from ``env`` (default ``os.environ``; decimal or ``0x`` hex), else 0.

        Raises:
            ValueError: an argument outside 0..255 (traffic class) or 0..15 (service level), or not an int; a
                variable that is not such an integer (the message names the variable and its value).
        """
        env = os.environ if env is None else env
        tc, tc_src = _qos_value("traffic_class", traffic_class, env)
        sl, sl_src = _qos_value("service_level", service_level, env)
        return cls(tc, sl, (tc_src, sl_src))


# -------------------------------------------------------------------------------- attribute building
def build_init_attr(api: SimpleNamespace, cq: Any, max_send_wr: int, max_recv_wr: int) -> Any:
    """``QPInitAttr`` of an RC QP on ``cq`` (send and receive) with one SGE per request, no sq_sig_all."""
    e = enums_of(api)
    cap = api.QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=1, max_recv_sge=1)
    return api.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def build_qp_attr(api: SimpleNamespace, *, port: int, local: QPInfo, remote: QPInfo, flow_label: int = 0,
                  traffic_class: int = 0, service_level: int = 0, hop_limit: int = 64, min_rnr_timer: int = 12,
                  rnr_retry: int = 7, retry_cnt: int = 7, timeout: int = 14, max_rd_atomic: int = 16) -> Any:
    """One ``QPAttr`` carrying everything INIT, RTR and RTS need (pyverbs' to_init/to_rtr/to_rts masks).

    Access: local write, remote write, remote atomic.  Path MTU: the smaller of both ends' active MTUs.  The
    address has a GRH (``is_global``) whenever the remote GID is non-zero (always on RoCE), with ``flow_label``
    (20 bits; selects the RoCEv2 UDP source port), ``traffic_class`` (0..255) and the local GID index; its
    ``sl`` is ``service_level`` (0..15); see :class:`QoS`.  Timers use the IB encodings (``timeout`` 14 = 67 ms
    local ACK timeout; ``min_rnr_timer`` 12 = 0.64 ms; ``rnr_retry`` 7 = forever).

    Raises:
        ValueError: ``traffic_class`` or ``service_level`` out of range.
    """
    QoS.resolve(traffic_class, service_level, env={})   # range checks only
    e = enums_of(api)
    attr = api.QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
    attr.port_num = port
    attr.pkey_index = 0
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
    attr.path_mtu = min(local.mtu, remote.mtu)
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.sq_psn = local.psn
    attr.max_dest_rd_atomic = max_rd_atomic
    attr.max_rd_atomic = max_rd_atomic
    attr.min_rnr_timer = min_rnr_timer
    attr.timeout, attr.retry_cnt, attr.rnr_retry = timeout, retry_cnt, rnr_retry
    is_global = 1 if remote.gid.strip("0:") else 0
    dgid = api.GID()
    dgid.gid = remote.gid
    gr = api.GlobalRoute(dgid=dgid, flow_label=flow_label & topology.FLOW_LABEL_MASK,
                         sgid_index=local.gid_index, hop_limit=hop_limit, traffic_class=traffic_class)
    attr.ah_attr = api.AHAttr(dlid=remote.lid, sl=service_level, is_global=is_global, port_num=port, gr=gr)
    return attr


def build_send_wr(api: SimpleNamespace, kind: str, wr_id: int, sge: Any, rkey: int, remote_addr: int,
                  imm: int = 0, add: int = 0, signaled: bool = False) -> Any:
    """A ``SendWR`` for WRITE, WRITE_WITH_IMM or FETCH_ADD (``compare_add`` carries the addend)."""
    e = enums_of(api)
    flags = e.IBV_SEND_SIGNALED if signaled else 0
    if kind == FETCH_ADD:
        wr = api.SendWR(wr_id=wr_id, opcode=e.IBV_WR_ATOMIC_FETCH_AND_ADD, num_sge=1, sg=[sge], send_flags=flags)
        wr.set_wr_atomic(rkey=rkey, addr=remote_addr, compare_add=add & ((1 << 64) - 1), swap=0)
        return wr
    op = e.IBV_WR_RDMA_WRITE_WITH_IMM if kind == WRITE_WITH_IMM else e.IBV_WR_RDMA_WRITE
    wr = api.SendWR(wr_id=wr_id, opcode=op, num_sge=1, imm_data=imm & 0xFFFFFFFF, sg=[sge], send_flags=flags)
    wr.set_wr_rdma(rkey, remote_addr)
    return wr

