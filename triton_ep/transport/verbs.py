"""RDMA transport on pyverbs (rdma-core's Python bindings): the one backend of :class:`rdma.Transport`.

It calls only the pyverbs API (``pyverbs.device.Context``, ``pyverbs.pd.PD``, ``pyverbs.mr.MR``,
``pyverbs.cq.CQ``, ``pyverbs.qp.QP/QPInitAttr/QPCap/QPAttr``, ``pyverbs.addr.AHAttr/GlobalRoute/GID``,
``pyverbs.wr.SendWR/RecvWR/SGE`` and, on mlx5, ``Mlx5QP.modify_udp_sport/modify_lag_port``), reached through a
namespace: :func:`load_pyverbs` builds it from the real package, and
:meth:`triton_ep.transport.emulated.Fabric.pyverbs` builds the same names over the emulated fabric.  So this
file runs unchanged in CI (emulated) and on a host with an RDMA NIC.

Enum layouts: rdma-core <= 58 exposes flat ``IBV_*`` names in ``pyverbs.enums``; with Cython >= 3.1
(rdma-core >= 59) the names live only inside enum classes of ``pyverbs.libibverbs_enums``
(``ibv_wr_opcode.IBV_WR_RDMA_WRITE``).  :class:`EnumShim` reads either.
"""
from __future__ import annotations

import ctypes
import enum as _enum
import ipaddress
import itertools
import operator
import os
import random
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from triton_ep.errors import EPTimeoutError
from triton_ep.transport import topology
from triton_ep.transport.rdma import (FETCH_ADD, WRITE, WRITE_WITH_IMM, Completion, Op, QPInfo,
                                      RdmaCompletionError, RdmaError, RdmaUnavailable, RemoteRegion, Transport)

NO_DEVICE_HINT = ("no RDMA device: {why}. This host has no usable RDMA NIC (or its kernel lacks RDMA); "
                  "use the emulated fabric (TRITON_EP_RDMA=emulated for a Buffer; triton_ep.transport.emulated.Fabric(...).pyverbs() for a transport alone)")

#: Work completion status names, in libibverbs' numbering (enum ibv_wc_status).
WC_STATUS_NAMES = ["IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
                   "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
                   "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR",
                   "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR",
                   "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR",
                   "IBV_WC_INV_EECN_ERR", "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
                   "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR"]

#: The enum names this backend needs (each resolved through :class:`EnumShim`).
NEEDED_ENUMS = ["IBV_QPT_RC", "IBV_QPS_RESET", "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS", "IBV_QPS_ERR",
                "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_ATOMIC",
                "IBV_WR_RDMA_WRITE", "IBV_WR_RDMA_WRITE_WITH_IMM", "IBV_WR_ATOMIC_FETCH_AND_ADD",
                "IBV_SEND_SIGNALED", "IBV_WC_SUCCESS", "IBV_WC_RDMA_WRITE", "IBV_WC_FETCH_ADD",
                "IBV_WC_RECV_RDMA_WITH_IMM", "IBV_MTU_4096", "IBV_PORT_ACTIVE", "IBV_LINK_LAYER_INFINIBAND",
                "IBV_LINK_LAYER_ETHERNET", "IBV_GID_TYPE_SYSFS_ROCE_V2"]


class EnumShim:
    """``IBV_*`` constants from pyverbs' enum module(s), whichever layout they use.

    Args:
        modules: the enum modules, e.g. ``pyverbs.libibverbs_enums`` and/or ``pyverbs.enums``.  A name is
            taken from a module attribute (flat layout, rdma-core <= 58) or from a member of an
            ``enum.Enum`` class in the module (class layout, rdma-core >= 59 / Cython >= 3.1).
    Attribute access returns an ``int``; an unknown name raises ``AttributeError`` naming the layout.
    """

    def __init__(self, *modules: Any) -> None:
        self.values: Dict[str, int] = {}
        self.layouts: List[str] = []
        for m in modules:
            flat = 0
            for name in dir(m):
                v = getattr(m, name)
                if name.startswith("IBV_") and not isinstance(v, type):
                    self.values.setdefault(name, int(v))
                    flat += 1
                elif isinstance(v, type) and issubclass(v, _enum.Enum):
                    for member in v:
                        if member.name.startswith("IBV_"):
                            self.values.setdefault(member.name, int(member.value))
            self.layouts.append(f"{getattr(m, '__name__', m)} ({'flat names' if flat else 'enum classes'})")

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(f"pyverbs enum {name} not found in {', '.join(self.layouts)}") from None

    def name_of(self, prefix: str, value: int, names: Sequence[str]) -> str:
        """The first of ``names`` whose value is ``value`` (else ``prefix`` + the number)."""
        for n in names:
            if self.values.get(n) == value:
                return n
        return f"{prefix}{value}"


def load_pyverbs() -> SimpleNamespace:
    """The real pyverbs as the namespace this backend uses.

    Raises:
        RdmaUnavailable: pyverbs does not import (say which import failed and how to install it).
    """
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.pyverbs_error as err
        import pyverbs.qp as qp
        import pyverbs.wr as wr
    except Exception as ex:  # ImportError, or a .so built for another libibverbs
        raise RdmaUnavailable(f"pyverbs does not import ({ex!r}); run scripts/install_pyverbs.sh "
                              f"or use the emulated transport") from ex
    mods = []
    for name in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
        try:
            mods.append(__import__(name, fromlist=["_"]))
        except ImportError:
            pass
    mlx5 = None
    try:
        from pyverbs.providers.mlx5.mlx5dv import Mlx5QP as mlx5
    except Exception:
        pass
    return SimpleNamespace(
        name="pyverbs", enums=EnumShim(*mods), get_device_list=device.get_device_list, Context=device.Context,
        PD=pd.PD, MR=mr.MR, CQ=cq.CQ, QP=qp.QP, QPInitAttr=qp.QPInitAttr, QPCap=qp.QPCap, QPAttr=qp.QPAttr,
        AHAttr=addr.AHAttr, GlobalRoute=addr.GlobalRoute, GID=addr.GID, SendWR=wr.SendWR, RecvWR=wr.RecvWR,
        SGE=wr.SGE, DmaBufMR=getattr(mr, "DmaBufMR", None), Mlx5QP=mlx5, PyverbsError=err.PyverbsError,
        PyverbsRDMAError=err.PyverbsRDMAError, PyverbsUserError=err.PyverbsUserError)


def enums_of(api: SimpleNamespace) -> EnumShim:
    """The :class:`EnumShim` of an API namespace (a plain enum module is wrapped once, in place)."""
    if not isinstance(api.enums, EnumShim):
        api.enums = EnumShim(api.enums)
    return api.enums


# ------------------------------------------------------------------------------------------- discovery
_LANE_GBPS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.3125, 16: 14.0625, 32: 25.78125, 64: 53.125, 128: 106.25, 256: 212.5}
_WIDTH = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
_NOMINAL = {2.5: 2.5, 5.0: 5.0, 10.0: 10.0, 10.3125: 10.0, 14.0625: 14.0, 25.78125: 25.0, 53.125: 50.0,
            106.25: 100.0, 212.5: 200.0}


def speed_gbps(active_speed: int, active_width: int) -> float:
    """Nominal link speed in Gb/s from ``ibv_port_attr.active_speed`` and ``active_width`` codes (0 if unknown)."""
    lane = _LANE_GBPS.get(active_speed)
    return _NOMINAL[lane] * _WIDTH.get(active_width, 0) if lane else 0.0


@dataclass
class GidInfo:
    """One GID table entry: index, GID (8 hex groups), type (``"RoCEv2"``, ``"RoCEv1"`` or ``"IB"``)."""
    index: int
    gid: str
    type: str

    def _address(self) -> Optional[ipaddress.IPv6Address]:
        try:
            return ipaddress.IPv6Address(self.gid)
        except ValueError:
            return None

    @property
    def ipv4_mapped(self) -> bool:
        """The GID is an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``): RoCE over an IPv4 interface."""
        a = self._address()
        return a is not None and a.ipv4_mapped is not None

    @property
    def link_local(self) -> bool:
        """The GID is an IPv6 link-local address (``fe80::/10``): it reaches only its own L2 segment on RoCE."""
        a = self._address()
        return a is not None and a.is_link_local


@dataclass
class PortInfo:
    """A port as discovered: state, link layer, speed (Gb/s), active MTU code, LID, GIDs."""
    device: str
    port: int
    active: bool
    link_layer: str
    speed_gbps: float
    mtu: int
    lid: int
    gids: List[GidInfo] = field(default_factory=list)

    def best_gid(self) -> Optional[GidInfo]:
        """The GID to send from (see :func:`pick_gid`: routable RoCEv2 first, link-local last, with a warning)."""
        return pick_gid(self.gids)


@dataclass
class DeviceInfo:
    """A device as discovered: name, vendor id, ports, and the most outstanding RDMA reads/atomics per QP."""
    name: str
    vendor_id: int
    ports: List[PortInfo] = field(default_factory=list)
    max_qp_rd_atom: int = 16

    @property
    def is_mlx5(self) -> bool:
        """A Mellanox/NVIDIA device driven by mlx5 (direct-verbs source/LAG port calls may work)."""
        return self.name.startswith("mlx5") or self.vendor_id in (0x02C9, 0x15B3)


def pick_gid(gids: Sequence[GidInfo]) -> Optional[GidInfo]:
    """The GID to send from; None if the table has no non-zero entry.

    Order (earlier wins, ties to the lowest index):

    1. a routable RoCEv2 GID: IPv4-mapped (``::ffff:a.b.c.d``) before a global IPv6 address;
    2. a routable RoCEv1 GID (RoCEv1 frames are plain Ethernet, so they stay on one L2 network anyway);
    3. a link-local GID (``fe80::/10``), RoCEv2 before RoCEv1, as a last resort: the kernel derives the
       destination MAC from it without address resolution, so it reaches only the local L2 segment, and
       a peer on another segment never answers (``IBV_WC_RETRY_EXC_ERR`` on the first send).  Choosing it
       issues a :class:`UserWarning` (``warnings.warn``).

    InfiniBand GIDs (type ``"IB"``) carry the subnet prefix, ``fe80::`` by default on any IB subnet, and are
    addressed by LID within it, so they are ranked by index only and never warned about.  Semantics: the GID
    types and addresses of rdma-core's ``/sys/class/infiniband/*/ports/*/gid_attrs`` (``ibv_query_gid_type``);
    the link-local MAC derivation is the kernel's ``rdma_link_local_addr`` / ``rdma_get_ll_mac``.  A fixed
    index (DeepEP's 3) is wrong on hosts whose GID table is laid out differently.
    """
    nonzero = [g for g in gids if g.gid.strip("0:")]
    if not nonzero:
        return None
    best = min(nonzero, key=lambda g: (g.type != "IB" and g.link_local, g.type != "RoCEv2", not g.ipv4_mapped,
                                       g.index))
    if best.type != "IB" and best.link_local:
        warnings.warn(f"RDMA: only a link-local GID ({best.gid}, index {best.index}, {best.type}) to send from: "
                      f"it reaches peers on this L2 segment only; give the interface a routable (IPv4 or "
                      f"global IPv6) address", stacklevel=2)
    return best


def discover(api: SimpleNamespace, names: Optional[Sequence[str]] = None,
             max_gids: Optional[int] = None) -> List[DeviceInfo]:
    """Open each RDMA device briefly and describe its ports and GIDs.

    Args:
        api: a namespace from :func:`load_pyverbs` or the emulated fabric.
        names: only these devices (default: all).
        max_gids: GID table entries read per port (default: the whole table, the port's ``gid_tbl_len``: RoCE
            ports list a GID per address and RoCE version, often more than 32).
    Raises:
        RdmaUnavailable: no device at all (message starts "no RDMA device: ... use the emulated fabric"; its
            ``device`` is None), or a device of ``names`` is not there (``device`` names it).
        RdmaError: a device fails to open or answer (names the device and port).
    """
    e = enums_of(api)
    try:
        devs = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in api.get_device_list()]
    except api.PyverbsError as ex:
        raise RdmaUnavailable(NO_DEVICE_HINT.format(why=f"listing devices failed ({ex})")) from None
    if not devs:
        raise RdmaUnavailable(NO_DEVICE_HINT.format(why="the device list is empty"))
    if names is not None:
        missing = [n for n in names if n not in devs]
        if missing:
            raise RdmaUnavailable(f"no such RDMA device: {missing} not among {devs}", device=missing[0])
        devs = list(names)
    out = []
    for name in devs:
        ctx = _call(api, "open device", lambda: api.Context(name=name), device=name)
        try:
            da = _call(api, "query device", ctx.query_device, device=name)
            info = DeviceInfo(name, int(getattr(da, "vendor_id", 0)),
                              max_qp_rd_atom=int(getattr(da, "max_qp_rd_atom", 16) or 1))
            for p in range(1, int(da.phys_port_cnt) + 1):
                pa = _call(api, "query port", lambda: ctx.query_port(p), device=name, port=p)
                ll = "InfiniBand" if pa.link_layer == e.IBV_LINK_LAYER_INFINIBAND else "Ethernet"
                port = PortInfo(name, p, pa.state == e.IBV_PORT_ACTIVE, ll,
                                speed_gbps(pa.active_speed, pa.active_width), int(pa.active_mtu), int(pa.lid))
                n_gids = int(pa.gid_tbl_len)
                for i in range(n_gids if max_gids is None else min(n_gids, max_gids)):
                    try:
                        g = str(ctx.query_gid(p, i).gid)
                        t = ctx.query_gid_type(p, i) if ll == "Ethernet" else -1
                    except api.PyverbsError:
                        continue
                    if g.strip("0:"):
                        kind = "RoCEv2" if t == e.IBV_GID_TYPE_SYSFS_ROCE_V2 else ("IB" if t < 0 else "RoCEv1")
                        port.gids.append(GidInfo(i, g, kind))
                info.ports.append(port)
            out.append(info)
        finally:
            ctx.close()
    return out


def ports_of(devices: Sequence[DeviceInfo], lag_ports: Optional[int] = None) -> List[topology.PortRef]:
    """Active ports as :class:`topology.PortRef` (with their best GID); a bonded mlx5 device's port is
    listed once per LAG member (``lag_ports``, default 2 for names containing ``bond``)."""
    out = []
    for d in devices:
        for p in d.ports:
            if not p.active:
                continue
            g = p.best_gid() or GidInfo(0, "", "IB")
            n = lag_ports if lag_ports is not None else (2 if d.is_mlx5 and "bond" in d.name else 0)
            for lag in (range(1, n + 1) if n and p.link_layer == "Ethernet" else [0]):
                out.append(topology.PortRef(d.name, p.port, g.gid, g.index, True, lag, p.link_layer, p.speed_gbps))
    return out


def _call(api: SimpleNamespace, what: str, fn, **where: Any):
    """Run a verbs call; turn a pyverbs error into :class:`RdmaError` naming ``where``."""
    try:
        return fn()
    except api.PyverbsError as ex:
        raise RdmaError(f"{what} failed: {ex}", errno=getattr(ex, "error_code", None), **where) from ex


# ------------------------------------------------------------------------------------------------ QoS
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


# ------------------------------------------------------------------------------------------ the backend
_RECV_BIT = 1 << 63


class Region:
    """Memory registered with every opened device.

    Attributes:
        addr: start address (host virtual, or GPU virtual for CUDA tensors); length: bytes.
        mrs: one pyverbs MR per device slot; lkeys/rkeys: their keys.  owner: keeps the memory alive.
    """

    def __init__(self, addr: int, length: int, mrs: List[Any], owner: Any, host: bool) -> None:
        self.addr, self.length, self.mrs, self.owner, self.host = addr, length, mrs, owner, host
        self.lkeys = [m.lkey for m in mrs]
        self.rkeys = tuple(m.rkey for m in mrs)

    @property
    def lkey(self) -> int:
        """The lkey on the first device."""
        return self.lkeys[0]

    @property
    def rkey(self) -> int:
        """The rkey on the first device."""
        return self.rkeys[0]

    def remote(self) -> RemoteRegion:
        """What a peer needs to write here (send it with :func:`rdma.exchange_regions`)."""
        return RemoteRegion(self.addr, self.length, self.rkeys)

    def view(self):
        """A ``numpy.uint8`` array over the region (host memory only)."""
        import numpy as np
        if not self.host:
            raise RdmaError("view() of GPU memory: copy it to the host first")
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.length).from_address(self.addr))


@dataclass
class _QP:
    peer: int
    index: int
    slot: int
    port: topology.PortRef
    qp: Any
    info: QPInfo
    flow_label: int = 0
    udp_sport: int = 0
    sport_forced: bool = False
    remote: Optional[QPInfo] = None
    seq: "itertools.count" = field(default_factory=lambda: itertools.count(1))
    inflight: List[tuple] = field(default_factory=list)   # (seq, user wr_id, user-signalled, kind)
    unsignaled_run: int = 0
    recvs_posted: int = 0
    #: key -> the work requests built once by :meth:`VerbsTransport.prepare` (None: this pyverbs cannot reuse them)
    prepared: Dict[Any, Optional["_Prepared"]] = field(default_factory=dict)
    #: receives built once, linked in a fixed chain ``recv_chain[i] -> recv_chain[i + 1] -> ... -> None``: posting
    #: ``n`` of them posts from ``recv_chain[-n]`` (a receive request is free again once ``post_recv`` returns)
    recv_chain: List[Any] = field(default_factory=list)
    #: receive completions polled since the receives were last replenished
    recv_owed: int = 0
    #: some key of :attr:`prepared` could not be built (this pyverbs): :meth:`VerbsTransport.post_prepared` posts Ops
    unprepared: bool = False


@dataclass(eq=False)
class _Prepared:
    """One prepared work request (:meth:`VerbsTransport.prepare`): its ``SGE``, and two ``SendWR``s reading it (set
    through ``sg_list``, so a new length is one store): ``link`` goes where another request follows it in a chain
    (its ``next_wr`` is set at each post), ``last`` ends a chain (never linked: pyverbs cannot set ``next_wr`` back
    to none). ``kind``: the ``Op`` kind; ``stamp``: the post that used it last (a key named twice in one call
    splits the chain)."""
    sge: Any
    link: Any
    last: Any
    kind: str
    stamp: int = -1


class VerbsTransport(Transport):
    """RC queue pairs to every peer over one or more RDMA devices, through pyverbs (real or emulated).

    Args:
        rank, world_size: this rank and the group size; QPs are made towards every other rank, or only to
            ``peers`` (distinct int ranks of the group other than ``rank``; e.g. the ranks on other hosts;
            empty: no QPs).
        api: namespace from :func:`load_pyverbs` (default) or ``emulated.Fabric(...).pyverbs(...)``.
        devices: device names to use (default: every device with an active port).
        num_qps_per_peer: RC QPs per peer, dealt over the active ports by :func:`topology.spread_ports`.
        sq_depth, rq_depth: send / receive queue depths per QP (work requests).
        n_paths, path_hash: flow labels are chosen so QPs spread evenly over ``n_paths`` ECMP paths of that
            hash (default: as many paths as QPs, CRC-32 of the 5-tuple as switches use).
        signal_every: force a signalled request after this many unsignalled ones (default sq_depth // 2),
            so send-queue slots are always reclaimed.
        auto_replenish: post consumed receives again as completions are polled, in chains of ``rq_depth // 8``
            (``recv_batch``: a QP keeps at least ``rq_depth - recv_batch + 1`` posted).
        min_rnr_timer, rnr_retry, retry_cnt, qp_timeout: IB-encoded QP timers (see :func:`build_qp_attr`).
        timeout_s: bound of every wait; exceeded -> ``EPTimeoutError``.
        force_sport: on mlx5, also set the UDP source port (and LAG port) directly after RTS.
        gpu: CUDA device index; without ``devices``, use the NICs nearest it on the PCI tree (real pyverbs).
        lag_ports: physical ports behind a bonded device (default: 2 for mlx5 devices named ``*bond*``);
            QPs are dealt over them and steered with ``modify_lag_port``.
        traffic_class: GRH traffic class of every QP (0..255; on RoCEv2 the IP DSCP/ECN byte); default: the
            ``TRITON_EP_RDMA_TC`` environment variable, else 0.  See :class:`QoS`.
        service_level: service level of every QP's address (0..15); default: ``TRITON_EP_RDMA_SL``, else 0.
    Raises:
        ValueError: a traffic class or service level out of range, from the argument or the environment (the
            message names the variable); ``peers`` holding this rank, a rank outside the group or a rank twice.
        TypeError: ``peers`` holding something other than ints.
        RdmaUnavailable: no pyverbs or no device ("no RDMA device: ... use the emulated fabric").
        RdmaError: a verbs call failed (names device, port, QP, peer).
    """

    def __init__(self, rank: int, world_size: int, *, api: Optional[SimpleNamespace] = None,
                 devices: Optional[Sequence[str]] = None, num_qps_per_peer: int = 2, sq_depth: int = 256,
                 rq_depth: int = 256, n_paths: Optional[int] = None, path_hash: topology.PathHash = topology.crc_path_hash,
                 signal_every: Optional[int] = None, auto_replenish: bool = True, min_rnr_timer: int = 12,
                 rnr_retry: int = 7, retry_cnt: int = 7, qp_timeout: int = 14, timeout_s: float = 30.0,
                 force_sport: bool = True, lag_ports: Optional[int] = None, gpu: Optional[int] = None,
                 seed: int = 0, traffic_class: Optional[int] = None, service_level: Optional[int] = None,
                 peers: Optional[Sequence[int]] = None) -> None:
        if peers is not None:
            peers = list(peers)
            try:
                if any(isinstance(p, bool) for p in peers):
                    raise TypeError
                peers = [operator.index(p) for p in peers]      # (ints, numpy's included)
            except TypeError:
                raise TypeError(f"peers must be a sequence of int ranks, got {peers!r}") from None
            bad = [p for p in peers if not 0 <= p < world_size or p == rank]
            if bad or len(set(peers)) != len(peers):
                raise ValueError(f"peers must be distinct ranks of the group other than this rank {rank} "
                                 f"(0..{world_size - 1}); got {peers}")
            self.peers = sorted(peers)
        self.qos = QoS.resolve(traffic_class, service_level)
        self.api = api if api is not None else load_pyverbs()
        self.e = enums_of(self.api)
        self._wc_success = self.e.IBV_WC_SUCCESS        # (read per work completion: no enum look-up there)
        self._send_signaled = self.e.IBV_SEND_SIGNALED  # (stored per post)
        self._stamp = 0         # (numbers the calls of _post_prepared_chain: a key met twice in one splits the chain)
        self.rank, self.world_size, self.num_qps_per_peer = rank, world_size, num_qps_per_peer
        self.sq_depth, self.rq_depth, self.timeout_s = sq_depth, rq_depth, timeout_s
        self.n_paths = num_qps_per_peer if n_paths is None else n_paths
        self.path_hash, self.auto_replenish, self.force_sport = path_hash, auto_replenish, force_sport
        self.signal_every = max(1, signal_every or sq_depth // 2)
        #: receives consumed on a QP before they are posted again (one chain): the QP keeps at least
        #: ``rq_depth - recv_batch + 1`` receives posted
        self.recv_batch = max(1, rq_depth // 8)
        self.timers = dict(min_rnr_timer=min_rnr_timer, rnr_retry=rnr_retry, retry_cnt=retry_cnt, timeout=qp_timeout)
        self._rng = random.Random(seed * 7919 + rank)
        self._closed = False
        if devices is None and gpu is not None and self.api.name == "pyverbs":
            near = topology.nearest_nics(topology.gpu_sysfs_path(gpu), topology.sysfs_nic_pci_paths())
            devices = near or None
        self.devices = [d for d in discover(self.api, devices) if any(p.active for p in d.ports)]
        if not self.devices:
            raise RdmaUnavailable(NO_DEVICE_HINT.format(why="no device has an active port"))
        self.ports = ports_of(self.devices, lag_ports)
        self.port_info = {(p.device, p.port): p for d in self.devices for p in d.ports}
        self.ctxs, self.pds, self.cqs, self.scratch = [], [], [], []
        self.qps: Dict[tuple, _QP] = {}
        self.by_qpn: Dict[tuple, _QP] = {}
        self.regions: List[Region] = []
        self._backlog: List[Completion] = []
        nq = num_qps_per_peer * max(1, len(self.peer_ranks()))
        for slot, d in enumerate(self.devices):
            ctx = _call(self.api, "open device", lambda: self.api.Context(name=d.name), device=d.name)
            self.ctxs.append(ctx)
            self.pds.append(_call(self.api, "alloc PD", lambda: self.api.PD(ctx), device=d.name))
            cqe = nq * (sq_depth + rq_depth) + 64
            self.cqs.append(_call(self.api, "create CQ", lambda: self.api.CQ(ctx, cqe, None, None, 0), device=d.name))
        self._scratch_buf = ctypes.create_string_buffer(64 * len(self.devices))
        for slot in range(len(self.devices)):
            self.scratch.append(self._mr(slot, None, 64, ctypes.addressof(self._scratch_buf) + 64 * slot,
                                         self._access(False, False)))
        for peer in self.peer_ranks():
            for i, port in enumerate(topology.spread_ports(num_qps_per_peer, self.ports)):
                self._create_qp(peer, i, port)

    # ---- setup
    def _slot(self, device: str) -> int:
        return [d.name for d in self.devices].index(device)

    def _access(self, remote_write: bool = True, remote_atomic: bool = True) -> int:
        e = self.e
        return (e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0)
                | (e.IBV_ACCESS_REMOTE_ATOMIC if remote_atomic else 0))

    def _mr(self, slot: int, owner: Any, length: int, addr: Optional[int] = None, acc: Optional[int] = None):
        acc = self._access() if acc is None else acc
        a = ctypes.addressof(owner) if addr is None else addr
        return _call(self.api, f"register {length} bytes at 0x{a:x}",
                     lambda: self.api.MR(self.pds[slot], length, acc, address=a), device=self.devices[slot].name)

    def _create_qp(self, peer: int, index: int, port: topology.PortRef) -> None:
        slot = self._slot(port.device)
        init = build_init_attr(self.api, self.cqs[slot], self.sq_depth, self.rq_depth)
        qp = _call(self.api, "create QP", lambda: self.api.QP(self.pds[slot], init), device=port.device,
                   port=port.port, peer=peer)
        pi = self.port_info[(port.device, port.port)]
        info = QPInfo(qp.qp_num, self._rng.randrange(1 << 24), port.gid or "0000:" * 7 + "0000", port.gid_index,
                      pi.lid, pi.mtu, port.port, port.device, slot)
        rec = _QP(peer, index, slot, port, qp, info)
        self.qps[(peer, index)] = rec
        self.by_qpn[(slot, qp.qp_num)] = rec

    def local_info(self, peer: int) -> List[QPInfo]:
        """This rank's QP infos towards ``peer`` (send them to the peer; see :func:`rdma.exchange_info`)."""
        return [self.qps[(peer, i)].info for i in range(self.num_qps_per_peer)]

    def plan(self, peer: int, remote: Sequence[QPInfo]) -> List[topology.QPPlanEntry]:
        """The flow plan towards ``peer``: each QP's port, flow label, UDP source port and path."""
        entries = [topology.QPPlanEntry(i, self.qps[(peer, i)].port) for i in range(self.num_qps_per_peer)]
        if self.n_paths > 0 and all(r.gid.strip("0:") for r in remote):
            topology.plan_flows(entries, [r.gid for r in remote], self.n_paths, self.path_hash, seed=self.rank)
        return entries

    def connect(self, peer: int, remote: Sequence[QPInfo]) -> None:
        """INIT -> RTR -> RTS for every QP towards ``peer``; then (mlx5) force UDP source and LAG ports.

        Each QP's address carries its planned flow label and this transport's :class:`QoS` (``self.qos``:
        traffic class and service level).  Raises :class:`RdmaError` naming the QP when a transition fails.
        """
        if len(remote) != self.num_qps_per_peer:
            raise RdmaError(f"peer sent {len(remote)} QP infos, expected {self.num_qps_per_peer}", peer=peer)
        for ent, r in zip(self.plan(peer, remote), remote):
            q = self.qps[(peer, ent.qp)]
            where = dict(device=q.port.device, port=q.port.port, qp_num=q.info.qp_num, peer=peer)
            attr = build_qp_attr(self.api, port=q.port.port, local=q.info, remote=r, flow_label=ent.flow_label,
                                 max_rd_atomic=min(16, self.devices[q.slot].max_qp_rd_atom),
                                 traffic_class=self.qos.traffic_class, service_level=self.qos.service_level,
                                 **self.timers)
            _call(self.api, "modify QP to INIT", lambda: q.qp.to_init(attr), **where)
            _call(self.api, "modify QP to RTR", lambda: q.qp.to_rtr(attr), **where)
            _call(self.api, "modify QP to RTS", lambda: q.qp.to_rts(attr), **where)
            q.remote, q.flow_label, q.udp_sport = r, ent.flow_label, ent.udp_sport
            dev = self.devices[q.slot]
            if self.force_sport and self.api.Mlx5QP is not None and dev.is_mlx5 and q.port.link_layer == "Ethernet":
                try:
                    if ent.udp_sport:
                        self.api.Mlx5QP.modify_udp_sport(q.qp, ent.udp_sport)
                        q.sport_forced = True
                    if q.port.lag_port:
                        self.api.Mlx5QP.modify_lag_port(q.qp, q.port.lag_port)
                except self.api.PyverbsError:
                    q.sport_forced = False   # the flow label still selects the source port
            if self.auto_replenish:
                self.post_recv(peer, ent.qp, self.rq_depth)

    def placement(self, peer: int) -> List[topology.QPPlanEntry]:
        """Each QP's port, flow label and UDP source port towards ``peer``, as :meth:`connect` set them."""
        return [topology.QPPlanEntry(i, q.port, q.flow_label, q.udp_sport)
                for i in range(self.num_qps_per_peer) for q in [self.qps[(peer, i)]]]

    def register(self, nbytes_or_tensor: Any, *, remote_write: bool = True, remote_atomic: bool = True) -> Region:
        """Register memory with every opened device; see :meth:`rdma.Transport.register`.

        Accepts an int (allocates page-aligned host memory), a contiguous numpy array, or a contiguous torch
        tensor.  CUDA tensors are registered through dma-buf where ``DmaBufMR`` and the CUDA driver allow it,
        else as plain addresses (needs a peer-memory driver such as nvidia-peermem).  Never run on a GPU host.
        """
        host = True
        if isinstance(nbytes_or_tensor, int):
            import numpy as np
            raw = np.zeros(nbytes_or_tensor + 4096, dtype=np.uint8)
            off = (-raw.ctypes.data) % 4096
            owner, addr, length = raw, raw.ctypes.data + off, nbytes_or_tensor
        elif hasattr(nbytes_or_tensor, "data_ptr"):
            t = nbytes_or_tensor
            if not t.is_contiguous():
                raise RdmaError("register(): tensor must be contiguous")
            owner, addr, length, host = t, t.data_ptr(), t.numel() * t.element_size(), not t.is_cuda
        else:
            a = nbytes_or_tensor
            if not a.flags["C_CONTIGUOUS"]:
                raise RdmaError("register(): array must be C-contiguous")
            owner, addr, length = a, a.ctypes.data, a.nbytes
        acc = self._access(remote_write, remote_atomic)
        mrs = []
        for slot in range(len(self.devices)):
            if host:
                mrs.append(self._mr(slot, owner, length, addr, acc))
            else:
                mrs.append(self._gpu_mr(slot, addr, length, acc))
        reg = Region(addr, length, mrs, owner, host)
        self.regions.append(reg)
        return reg

    def _gpu_mr(self, slot: int, addr: int, length: int, acc: int) -> Any:
        """dma-buf registration of GPU memory (CUDA driver ``cuMemGetHandleForAddressRange``), else plain."""
        if self.api.DmaBufMR is not None:
            try:
                cuda = ctypes.CDLL("libcuda.so.1")
                fd = ctypes.c_int(-1)
                page = 1 << 16
                base = addr - addr % page
                size = -(-(addr + length - base) // page) * page
                if cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(size),
                                                      1, ctypes.c_ulonglong(0)) == 0:
                    return self.api.DmaBufMR(self.pds[slot], size, acc, dmabuf=fd.value, offset=addr - base)
            except (OSError, AttributeError, self.api.PyverbsError):
                pass
        return self._mr(slot, None, length, addr, acc)

    # ---- data path
    def _sge(self, q: _QP, region: Region, offset: int, length: int) -> Any:
        return self.api.SGE(region.addr + offset, length, region.lkeys[q.slot])

    def post(self, peer: int, qp: int, ops: Sequence[Op]) -> List[int]:
        """Post ``ops`` in order on one QP; see :meth:`rdma.Transport.post`.  Returns the user wr_ids.

        The ops go out as chains of as many as the send queue has room for (one ``post_send`` per chain).
        A chain that fills the queue ends with a signalled request, and every ``signal_every``-th request is
        signalled, so a full queue always has a completion coming that frees it.
        """
        q = self.qps[(peer, qp)]
        where = dict(device=q.port.device, port=q.port.port, qp_num=q.info.qp_num, peer=peer)
        if q.remote is None:
            raise RdmaError("post before connect()", **where)
        bad = [op.kind for op in ops if op.kind not in (WRITE, WRITE_WITH_IMM, FETCH_ADD)]
        if bad:
            raise RdmaError(f"unknown op kind {bad[0]!r}", **where)
        ids: List[int] = []
        i = 0
        while i < len(ops):
            if len(q.inflight) >= self.sq_depth:
                self.wait(lambda _: len(q.inflight) < self.sq_depth, stage="rdma/send-queue space", peer=peer,
                          channel=qp, keep=True)
            chunk = ops[i:i + self.sq_depth - len(q.inflight)]
            ids += self._post_chain(q, chunk, fills=len(q.inflight) + len(chunk) == self.sq_depth, where=where)
            i += len(chunk)
        return ids

    def _post_chain(self, q: _QP, ops: Sequence[Op], fills: bool, where: dict) -> List[int]:
        """Build and post one chain of send WRs on ``q``; ``fills``: it takes the last free slot."""
        wrs, ids = [], []
        for k, op in enumerate(ops):
            seq = next(q.seq)
            q.unsignaled_run += 1
            sig = op.signaled or q.unsignaled_run >= self.signal_every or (fills and k == len(ops) - 1)
            if sig:
                q.unsignaled_run = 0
            uid = seq if op.wr_id is None else op.wr_id
            rkeys = op.remote.rkeys
            rkey = rkeys[q.remote.dev_slot] if q.remote.dev_slot < len(rkeys) else rkeys[0]
            length = 8 if op.kind == FETCH_ADD else op.length
            wrs.append(build_send_wr(self.api, op.kind, (q.slot << 56) | seq, self._sge(q, op.region, op.offset, length),
                                     rkey, op.remote.addr + op.remote_offset, op.imm, op.add, sig))
            q.inflight.append((seq, uid, op.signaled, op.kind))
            ids.append(uid)
        for a, b in zip(wrs, wrs[1:]):
            a.next_wr = b
        try:
            _call(self.api, "post_send", lambda: q.qp.post_send(wrs[0]), **where)
        except RdmaError:
            del q.inflight[len(q.inflight) - len(wrs):]
            raise
        return ids

    def wait(self, predicate, *, stage: str, peer: Optional[int] = None, timeout_s: Optional[float] = None,
             raise_on_error: bool = True, channel: Optional[int] = None, keep: bool = False) -> List[Completion]:
        """Poll until ``predicate(completions)`` holds; raises ``EPTimeoutError`` after ``timeout_s``.

        With ``keep`` the completions stay queued for the next :meth:`poll` instead of being returned.
        """
        import time
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        got: List[Completion] = []
        spins = 0
        while not predicate(got):
            new = self._poll_cqs(64)
            if keep:
                self._backlog.extend(new)
            else:
                got.extend(new)
                if raise_on_error:
                    self._raise_failed(got)
            if not new:
                if time.monotonic() > deadline:
                    raise EPTimeoutError(self.rank, peer, stage, t, channel)
                spins += 1
                if spins > 32:
                    time.sleep(0.0001)
        return got

    def post_recv(self, peer: int, qp: int, count: int) -> None:
        """Post ``count`` receives (one 64-byte scratch SGE each; WRITE_WITH_IMM writes no payload there), as one
        chain of receive requests built once per QP (``rq_depth`` of them, the first time) and posted again."""
        q = self.qps[(peer, qp)]
        if count <= 0:
            return
        if not q.recv_chain:
            sc = self.scratch[q.slot]
            q.recv_chain = [self.api.RecvWR(wr_id=_RECV_BIT | (q.slot << 56) | q.info.qp_num, num_sge=1,
                                            sg=[self.api.SGE(sc.buf, 64, sc.lkey)]) for _ in range(self.rq_depth)]
            for a, b in zip(q.recv_chain, q.recv_chain[1:]):
                a.next_wr = b
        chain = q.recv_chain
        while count > 0:
            n = min(count, len(chain))
            try:
                q.qp.post_recv(chain[len(chain) - n])
            except self.api.PyverbsError as ex:
                raise RdmaError(f"post_recv failed: {ex}", errno=getattr(ex, "error_code", None),
                                device=q.port.device, port=q.port.port, qp_num=q.info.qp_num, peer=peer) from ex
            q.recvs_posted += n
            count -= n

    def prepare(self, peer: int, qp: int, key: Any, op: Op) -> None:
        """Build ``op``'s work request once for QP ``qp`` of ``peer`` (see :meth:`rdma.Transport.prepare`): an
        ``SGE`` and two ``SendWR``s that read it through ``sg_list``. Where this pyverbs cannot point a request at an
        ``SGE`` or set its immediate (older rdma-core), the key posts through :meth:`post` instead.

        Raises :class:`RdmaError`: a kind other than WRITE / WRITE_WITH_IMM, or a QP not connected."""
        q = self.qps[(peer, qp)]
        if q.remote is None:
            raise RdmaError("prepare before connect()", device=q.port.device, port=q.port.port,
                            qp_num=q.info.qp_num, peer=peer)
        super().prepare(peer, qp, key, op)          # (checks the kind; the fallback's Op)
        rkeys = op.remote.rkeys
        rkey = rkeys[q.remote.dev_slot] if q.remote.dev_slot < len(rkeys) else rkeys[0]
        sge = self.api.SGE(op.region.addr + op.offset, op.length, op.region.lkeys[q.slot])
        pair = [build_send_wr(self.api, op.kind, 0, sge, rkey, op.remote.addr + op.remote_offset, op.imm)
                for _ in range(2)]
        try:
            for wr in pair:
                wr.sg_list = sge
                wr.imm_data = op.imm & 0xFFFFFFFF
        except (AttributeError, TypeError):
            q.prepared[key] = None
            q.unprepared = True
            return
        q.prepared[key] = _Prepared(sge, pair[0], pair[1], op.kind)

    def post_prepared(self, peer: int, qp: int, reqs: Sequence[Tuple[Any, int, int, Optional[int], bool]]) -> None:
        """Post prepared work requests in order on one QP (see :meth:`rdma.Transport.post_prepared`): per request
        only its ``SGE``'s length, its immediate, ``wr_id`` and flags are stored, the requests are linked, and each
        chain (as long as the send queue has room for; a key named twice in one chain ends it) is one
        ``post_send``. Selective signalling as :meth:`post`."""
        q = self.qps[(peer, qp)]
        if q.unprepared:        # (this pyverbs: no reusable requests)
            return super().post_prepared(peer, qp, reqs)
        i, n = 0, len(reqs)
        while i < n:
            room = self.sq_depth - len(q.inflight)
            if room <= 0:
                self.wait(lambda _: len(q.inflight) < self.sq_depth, stage="rdma/send-queue space", peer=peer,
                          channel=qp, keep=True)
                continue
            i += self._post_prepared_chain(q, reqs, i, min(n, i + room))

    def _post_prepared_chain(self, q: _QP, reqs: Sequence[tuple], i: int, end: int) -> int:
        """Post ``reqs[i:end]`` (or its part before a key met twice) as one chain on ``q``; returns how many."""
        self._stamp = stamp = self._stamp + 1
        prepared, sig_flag, every = q.prepared, self._send_signaled, self.signal_every
        if end - i == 1:        # (the common case: one request)
            ents = [prepared[reqs[i][0]]]
        else:
            ents, j = [], i
            while j < end:
                p = prepared[reqs[j][0]]
                if p.stamp == stamp:
                    break
                p.stamp = stamp
                ents.append(p)
                j += 1
        last = len(ents) - 1
        inflight = q.inflight
        base = len(inflight)
        fills = base + len(ents) == self.sq_depth
        prev = head = None
        slot_bits = q.slot << 56
        for k, p in enumerate(ents):
            key, length, imm, wr_id, signaled = reqs[i + k]
            seq = next(q.seq)
            q.unsignaled_run += 1
            sig = signaled or q.unsignaled_run >= every or (fills and k == last)
            if sig:
                q.unsignaled_run = 0
            wr = p.last if k == last else p.link
            wr.wr_id = slot_bits | seq
            wr.send_flags = sig_flag if sig else 0
            if p.kind == WRITE_WITH_IMM:
                wr.imm_data = imm & 0xFFFFFFFF
            p.sge.length = length
            if prev is None:
                head = wr
            else:
                prev.next_wr = wr
            prev = wr
            inflight.append((seq, seq if wr_id is None else wr_id, signaled, p.kind))
        try:
            q.qp.post_send(head)
        except self.api.PyverbsError as ex:
            del q.inflight[base:]
            raise RdmaError(f"post_send failed: {ex}", errno=getattr(ex, "error_code", None), device=q.port.device,
                            port=q.port.port, qp_num=q.info.qp_num, peer=q.peer) from ex
        return len(ents)

    def poll(self, max_entries: int = 64, raise_on_error: bool = True) -> List[Completion]:
        """Completions since the last call (queued ones first); see :meth:`rdma.Transport.poll`."""
        out = self._poll_cqs(max_entries)
        if self._backlog:
            out, self._backlog = self._backlog + out, []
        if raise_on_error and out:
            self._raise_failed(out)
        return out

    def _raise_failed(self, comps: List[Completion]) -> None:
        """Raise :class:`RdmaCompletionError` for the first failed completion in ``comps``."""
        for c in comps:
            if not c.ok:
                q = self.qps.get((c.peer, c.qp))
                raise RdmaCompletionError(f"work request {c.wr_id} ({c.opcode}) failed with {c.status}", c, comps,
                                          device=q.port.device if q else None, port=q.port.port if q else None,
                                          qp_num=c.qp_num, peer=c.peer)

    def _poll_cqs(self, max_entries: int) -> List[Completion]:
        """One ``poll`` of every CQ (up to ``max_entries`` work completions each); a QP whose consumed receives
        reached ``recv_batch`` gets them posted again afterwards, one chain (``auto_replenish``)."""
        out: List[Completion] = []
        owed: List[_QP] = []
        for slot, cq in enumerate(self.cqs):
            try:
                n, wcs = cq.poll(max_entries)
            except self.api.PyverbsError as ex:
                raise RdmaError(f"poll CQ failed: {ex}", errno=getattr(ex, "error_code", None),
                                device=self.devices[slot].name) from ex
            if n:
                completion = self._completion
                for wc in wcs[:n]:
                    c = completion(slot, wc, owed)
                    if c is not None:
                        out.append(c)
        for q in owed:
            n, q.recv_owed = q.recv_owed, 0
            self.post_recv(q.peer, q.index, n)
        return out

    def _completion(self, slot: int, wc: Any, owed: List[_QP]) -> Optional[Completion]:
        """The :class:`Completion` of work completion ``wc`` of CQ ``slot`` (None: nothing to report: an unsignalled
        request's, a flushed receive's); a consumed receive is counted on its QP, which goes into ``owed`` once
        ``recv_batch`` are owed."""
        q = self.by_qpn.get((slot, wc.qp_num))
        ok = wc.status == self._wc_success
        status = "IBV_WC_SUCCESS" if ok else self.e.name_of("IBV_WC_STATUS_", wc.status, WC_STATUS_NAMES)
        peer, idx = (q.peer, q.index) if q else (None, None)
        if wc.wr_id & _RECV_BIT:   # classify by wr_id: the opcode of an error completion is undefined
            if q is not None:
                q.recvs_posted -= 1
                if self.auto_replenish and ok:
                    q.recv_owed += 1
                    if q.recv_owed == self.recv_batch:
                        owed.append(q)
            if not ok and status == "IBV_WC_WR_FLUSH_ERR":
                return None   # a flushed receive: the send side reports the failure
            return Completion(status, "recv_imm", wc.wr_id & ~_RECV_BIT, int(wc.imm_data) if ok else None,
                              wc.qp_num, peer, idx, int(wc.byte_len))
        seq = wc.wr_id & ((1 << 56) - 1)
        if q is None:
            return Completion(status, "unknown", wc.wr_id, None, wc.qp_num, None, None)
        inflight = q.inflight
        k = seq - inflight[0][0] if inflight else -1      # (a QP's requests are numbered 1, 2, 3, ... in order)
        if not 0 <= k < len(inflight) or inflight[k][0] != seq:     # (numbers skipped by a failed post: search)
            k = next((i for i, ent in enumerate(inflight) if ent[0] == seq), -1)
            if k < 0:
                return None
        _, uid, usig, kind = inflight[k]
        del inflight[:k + 1]   # this completion retires every earlier (unsignalled) request of the QP
        if usig or not ok:
            return Completion(status, kind, uid, None, wc.qp_num, peer, idx, int(wc.byte_len))
        return None

    def qp_state(self, peer: int, qp: int) -> str:
        """``"RTS"``, ``"ERR"``, ... of QP ``qp`` towards ``peer`` (queried from the device)."""
        st = self.qps[(peer, qp)].qp.qp_state
        return self.e.name_of("IBV_QPS_", st, ["IBV_QPS_RESET", "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS",
                                               "IBV_QPS_ERR"]).replace("IBV_QPS_", "")

    def close(self) -> None:
        """Destroy QPs, MRs, CQs, PDs and close the devices (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for q in self.qps.values():
            q.qp.close()
        for r in self.regions:
            for m in r.mrs:
                m.close()
        for m in self.scratch:
            m.close()
        for o in self.cqs + self.pds + self.ctxs:
            o.close()


__all__ = ["VerbsTransport", "Region", "EnumShim", "load_pyverbs", "discover", "ports_of", "pick_gid", "speed_gbps",
           "build_init_attr", "build_qp_attr", "build_send_wr", "DeviceInfo", "PortInfo", "GidInfo",
           "NO_DEVICE_HINT", "WC_STATUS_NAMES", "QoS", "QOS_ENV"]
