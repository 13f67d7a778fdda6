"""An emulated RDMA fabric offering the subset of pyverbs that :mod:`triton_ep.transport.verbs` calls.

``Fabric(spec).pyverbs(devices=...)`` returns a namespace with the same class and method names as rdma-core's
pyverbs (Context, PD, MR, CQ, QP, QPInitAttr, QPCap, QPAttr, AHAttr, GlobalRoute, GID, SendWR, RecvWR, SGE,
get_device_list, the enums, PyverbsRDMAError, and mlx5's Mlx5QP.modify_udp_sport / modify_lag_port), so the
verbs backend runs unchanged on it in CI and on real pyverbs with a NIC.

What it models -- the promises of the InfiniBand verbs spec for RC queue pairs, and no more:

* Work requests of one QP are placed in order; nothing orders different QPs.  With ``FabricSpec.reorder_seed``
  each arriving request is held for a seeded random delay (monotone per QP), so QPs overtake each other;
  ``FabricSpec.skew_s`` holds the requests of every even-numbered QP longer, so they are overtaken for sure.
* A send completion is generated only after the responder placed the data (it answers with an ACK after
  the copy).  FETCH_AND_ADD returns the previous value into the local 8-byte slot before completing.
* WRITE_WITH_IMM consumes one posted receive; with none posted the responder sends RNR NAKs: the request
  is retried every ``min_rnr_timer`` interval up to the requester's ``rnr_retry`` (7 = forever), then
  completes with ``IBV_WC_RNR_RETRY_EXC_ERR``.
* The responder checks rkey, PD, bounds and access flags (``IBV_WC_REM_ACCESS_ERR``) and atomic alignment
  (``IBV_WC_REM_INV_REQ_ERR``); the requester checks lkeys (``IBV_WC_LOC_PROT_ERR``).  An error moves the
  QP (requester, and responder for remote errors) to ERR; outstanding and later requests complete with
  ``IBV_WC_WR_FLUSH_ERR``; error completions are generated whether signalled or not.
* Send-queue depth: a request occupies its slot until the completion of it or of a later signalled
  request on the same QP is polled; posting into a full queue fails with ENOMEM, as ibv_post_send does.
  Receive-queue depth likewise.  CQ depth: a completion arriving at a full CQ is an overrun; the next poll
  raises.
* Ports have a GID table, an active MTU and an L2 segment (:class:`PortSpec`).  RTR rejects (EINVAL) a path
  MTU above either end's active MTU, an SL above 15, a traffic class above 255, a bad source GID index; a
  routable destination GID that no port owns fails RTR with EHOSTUNREACH.  A link-local GID (``fe80::/10``)
  reaches only ports on the same segment, and a GID whose port lacks the destination QP reaches nobody: such
  a QP gets to RTS, its requests are lost, and the oldest completes with ``IBV_WC_RETRY_EXC_ERR`` after
  (``retry_cnt`` + 1) local ACK timeouts (the QP moves to ERR, the rest flush).  The QP keeps a copy of the
  ``AHAttr`` given at RTR (``qp.ah``).
* A rate model (:class:`RateModel`) charges each request's bytes to the sending port, the fabric path
  (ECMP: ``topology.emulator_path_hash(src GID, dst GID, UDP source port) % n_paths``) and the receiving
  port, each with a bandwidth cap, in virtual time.  The UDP source port is derived from the GRH flow label
  as the kernel does, or forced through the emulated mlx5 call.

* A QP whose process is gone (killed, crashed) or that was destroyed answers nothing, as a real HCA drops the
  packets of a QP that no longer exists: a request to it completes with ``IBV_WC_RETRY_EXC_ERR`` after the
  requester's retry time (:meth:`QP.retry_time_s`; 0.54 s at the verbs backend's ``timeout`` 14, ``retry_cnt``
  7), the QP moves to ERR and the rest flush. The fabric knows it from a lock: each QP's process holds an
  open-file-description lock on its inbound ring's file (:func:`triton_ep.transport.liveness.lock_byte`), which
  the kernel releases when the process ends; a requester looks at it (``F_OFD_GETLK``) every
  :data:`PEER_LOOK_S` while requests are outstanding, and before it waits for room in a full ring.

Transport between endpoints: every QP owns an inbound ring in a file under /dev/shm; requests, ACKs and NAKs
are records in those rings, so endpoints may live in threads of one process or in separate processes.
One progress thread per process (started on first use) plays both HCAs' roles for that process's QPs:
it places inbound data with ``ctypes.memmove`` into registered memory of its own process.  A device is
meant to be opened by one process.  The rate model's state is per process (exact when all senders of a
measurement share a process, as the benchmark's do).
"""
from __future__ import annotations

import atexit
import collections
import copy
import ctypes
import errno as _errno
import ipaddress
import mmap
import os
import random
import struct
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

from triton_ep.transport import liveness, topology
from triton_ep.transport.shm import shm_name

#: seconds between a requester's looks at whether the QPs it has requests outstanding at still exist (their
#: process's lock on the ring file)
PEER_LOOK_S = 0.05


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


# ------------------------------------------------------------------------------------------ the fabric
@dataclass
class PortSpec:
    """One emulated port.

    Attributes:
        link_layer: ``"Ethernet"`` (RoCE) or ``"InfiniBand"``.
        speed_gbps: link speed in Gb/s (per LAG member when bonded).
        active: port state ACTIVE (else DOWN).
        lag_ports: 0: not bonded; n: a bonded device's port made of n physical ports.
        gids: the GID table, ``[(gid, type), ...]`` in index order; a GID in any IPv6 text form
            (``"2001:db8::1"``), a type ``"RoCEv2"``, ``"RoCEv1"`` or ``"IB"`` (or the sysfs number,
            ``IBV_GID_TYPE_SYSFS_*``).  None: the mlx5-like default of :func:`port_gids`.
        active_mtu: the port's active MTU in bytes (256, 512, 1024, 2048 or 4096), as ``ibv_query_port``
            reports it; a QP's path MTU above either end's active MTU fails RTR with EINVAL.
        segment: the L2 segment (broadcast domain) of an Ethernet port: a link-local GID (``fe80::/10``) reaches
            only ports with the same segment.  None: a segment of its own (reached by no other port).
    Raises (at first use of the table):
        ValueError: a GID that is not an IPv6 address, an unknown type, or an MTU not in the list.
    """
    link_layer: str = "Ethernet"
    speed_gbps: float = 400.0
    active: bool = True
    lag_ports: int = 0
    gids: Optional[List[Tuple[str, object]]] = None
    active_mtu: int = 4096
    segment: Optional[str] = None


@dataclass
class DeviceSpec:
    """One emulated RDMA device (HCA): its name (``mlx5_*`` names enable the mlx5 calls) and ports."""
    name: str
    ports: List[PortSpec] = field(default_factory=lambda: [PortSpec()])


@dataclass
class FabricSpec:
    """The emulated fabric: devices, ECMP paths and their caps, reordering, ring size.

    Attributes:
        devices: every device on the fabric (index in this list fixes its GIDs and LIDs).
        n_paths: ECMP paths between any two ports; path_gbps: each path's bandwidth cap, Gb/s.
        reorder_seed: None: deliver as soon as possible; an int: hold each request a seeded random delay
            of up to ``reorder_max_s`` seconds (monotone per QP) so QPs overtake each other.
        skew_s: hold every request that arrives at an even-numbered QP this many seconds more (monotone per
            QP): a request on an odd-numbered QP overtakes one on an even-numbered QP posted less than
            ``skew_s`` before it, whatever the host's speed (tests of cross-QP ordering bugs).
        ring_bytes: capacity of each QP's inbound ring (bytes); writes larger than a quarter are fragmented.
    """
    devices: List[DeviceSpec]
    n_paths: int = 4
    path_gbps: float = 400.0
    reorder_seed: Optional[int] = None
    reorder_max_s: float = 0.004
    skew_s: float = 0.0
    ring_bytes: int = 1 << 20


def port_gids(dev_index: int, port: int, link_layer: str) -> List[Tuple[str, int]]:
    """The GID table of an emulated port: ``[(gid, sysfs gid type), ...]``, laid out like a RoCE mlx5 port.

    Ethernet: link-local RoCEv1, link-local RoCEv2, IPv4-mapped RoCEv1, IPv4-mapped RoCEv2 (10.d.p.1).
    InfiniBand: one GID (subnet prefix fe80::, GUID from the device and port).
    """
    ll = "fe80:0000:0000:0000:0200:00ff:fe%02x:%04x" % (dev_index & 0xFF, port)
    if link_layer == "InfiniBand":
        return [(ll, E.IBV_GID_TYPE_SYSFS_IB_ROCE_V1)]
    v4 = "0000:0000:0000:0000:0000:ffff:0a%02x:%02x01" % (dev_index & 0xFF, port & 0xFF)
    return [(ll, E.IBV_GID_TYPE_SYSFS_IB_ROCE_V1), (ll, E.IBV_GID_TYPE_SYSFS_ROCE_V2),
            (v4, E.IBV_GID_TYPE_SYSFS_IB_ROCE_V1), (v4, E.IBV_GID_TYPE_SYSFS_ROCE_V2)]


def port_lid(dev_index: int, port: int) -> int:
    """LID of an emulated InfiniBand port (Ethernet ports report 0)."""
    return (dev_index + 1) * 16 + port


_GID_TYPES = {"RoCEv2": E.IBV_GID_TYPE_SYSFS_ROCE_V2, "RoCEv1": E.IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
              "IB": E.IBV_GID_TYPE_SYSFS_IB_ROCE_V1}
_MTU_CODES = {256: E.IBV_MTU_256, 512: E.IBV_MTU_512, 1024: E.IBV_MTU_1024, 2048: E.IBV_MTU_2048,
              4096: E.IBV_MTU_4096}


def gid_table(ps: PortSpec, dev_index: int, port: int) -> List[Tuple[str, int]]:
    """The GID table of port ``port`` of device ``dev_index``: ``PortSpec.gids`` normalized to pyverbs' form
    (8 groups of 4 lowercase hex digits) with sysfs type numbers, else :func:`port_gids`.

    Raises:
        ValueError: a GID that is not an IPv6 address, or an unknown type name.
    """
    if ps.gids is None:
        return port_gids(dev_index, port, ps.link_layer)
    out = []
    for gid, kind in ps.gids:
        t = kind if isinstance(kind, int) else _GID_TYPES.get(kind)
        if t is None:
            raise ValueError(f"GID type {kind!r}: expected one of {sorted(_GID_TYPES)} or a sysfs number")
        out.append((ipaddress.IPv6Address(gid).exploded, t))
    return out


def mtu_code(ps: PortSpec) -> int:
    """``IBV_MTU_*`` code of the port's active MTU (``PortSpec.active_mtu``, bytes); ValueError if not valid."""
    try:
        return _MTU_CODES[ps.active_mtu]
    except KeyError:
        raise ValueError(f"active_mtu {ps.active_mtu}: expected one of {sorted(_MTU_CODES)}") from None


def segment_of(ps: PortSpec, dev_index: int, port: int) -> str:
    """The L2 segment id of a port: ``PortSpec.segment``, else one of its own."""
    return ps.segment if ps.segment is not None else f"port {dev_index}/{port}"


def is_link_local(gid: str) -> bool:
    """``gid`` is in ``fe80::/10`` (an IPv6 link-local address; False for anything not IPv6)."""
    try:
        return ipaddress.IPv6Address(gid).is_link_local
    except ValueError:
        return False


class RateModel:
    """Virtual-time bandwidth model: busy-until per resource (sending port, path, receiving port, QP).

    A request of ``n`` bytes starts when its QP, its sending port, its path and the receiving port are all
    free (never before ``t0``); it occupies each resource for ``n / bandwidth`` and finishes after
    ``n / min(bandwidths)``.  Units: bytes, bytes per second, seconds.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget all traffic: virtual time restarts at 0."""
        self.free: Dict[tuple, float] = collections.defaultdict(float)
        self.bytes: Dict[tuple, int] = collections.defaultdict(int)
        self.end = 0.0

    def charge(self, qp_key: tuple, resources: List[Tuple[tuple, float]], nbytes: int, t0: float = 0.0) -> float:
        """Charge ``nbytes`` to ``resources`` ([(key, bytes/s)]) after ``qp_key``'s previous request; returns end.
        A zero-byte request is ordered after its QP's previous one and occupies no resource."""
        with self.lock:
            if nbytes <= 0:      # a zero-length request (a bare WRITE_WITH_IMM) holds no link, only its QP's order
                end = self.free[qp_key] = max(t0, self.free[qp_key])
                self.end = max(self.end, end)
                return end
            start = max([t0, self.free[qp_key]] + [self.free[k] for k, _ in resources])
            slowest = min(bw for _, bw in resources)
            for k, bw in resources:
                self.free[k] = start + nbytes / bw
                self.bytes[k] += nbytes
            end = start + nbytes / slowest
            self.free[qp_key] = end
            self.end = max(self.end, end)
            return end

    def makespan(self) -> float:
        """Virtual time at which the last charged request finished (seconds)."""
        return self.end


class Fabric:
    """An emulated fabric; picklable (spec and a token), so child processes join the same fabric.

    Args:
        spec: the :class:`FabricSpec`.
        token: names this fabric's shared-memory files; generated when None.
        shm_dir: folder for the ring files (default /dev/shm, else the temp folder).

    The ring files are named as triton-ep's other shared-memory files
    (:func:`triton_ep.transport.ipc.shm_name`, so ``$TRITON_EP_SHM_TAG`` tags them, read at construction:
    processes joining one fabric must share it), then ``tep_<token>_q<QP number>``.

    Raises:
        ValueError: a ``$TRITON_EP_SHM_TAG`` with characters other than letters, digits, ``_`` and ``-``.
    """

    def __init__(self, spec: FabricSpec, token: Optional[str] = None, shm_dir: Optional[str] = None) -> None:
        self.spec = spec
        self.token = token or uuid.uuid4().hex[:12]
        self.shm_dir = shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        #: the ring files' path up to the QP number
        self.ring_prefix = os.path.join(self.shm_dir, shm_name(f"tep_{self.token}_q"))

    def __getstate__(self) -> dict:
        return {"spec": self.spec, "token": self.token, "shm_dir": self.shm_dir, "ring_prefix": self.ring_prefix}

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)

    def unlink_rings(self) -> None:
        """Remove the names of the ring files this process created for this fabric, keeping them mapped: once
        every peer has moved its QPs to RTR (which maps their rings), nothing stays in ``shm_dir`` even if a
        process is killed (the files go with their last mapping)."""
        for path in [p for p in _created_rings if p.startswith(self.ring_prefix)]:
            try:
                os.unlink(path)
            except OSError:
                pass
            _created_rings.discard(path)

    @property
    def engine(self) -> "_Engine":
        """This process's engine for the fabric (created on first use)."""
        return _Engine.get(self)

    @property
    def model(self) -> RateModel:
        """This process's rate model."""
        return self.engine.model

    def device_index(self, name: str) -> int:
        """Index of device ``name`` in the spec; ``PyverbsRDMAError(ENODEV)`` when absent."""
        for i, d in enumerate(self.spec.devices):
            if d.name == name:
                return i
        raise PyverbsRDMAError(f"Failed to open device {name}", _errno.ENODEV)

    def ports(self):
        """Every port of the fabric: ``(device index, port number, PortSpec)``."""
        for i, d in enumerate(self.spec.devices):
            for p, ps in enumerate(d.ports, 1):
                yield i, p, ps

    def resolve(self, gid: str, dlid: int, src: Optional[Tuple[int, int]] = None, sgid: str = "") -> Tuple[int, int]:
        """(device index, port) that owns GID ``gid`` (or, when the GID is zero, LID ``dlid``); KeyError if none.
        With ``src`` (and the source GID ``sgid``), an owner that :meth:`reaches` from there comes first (the same
        link-local GID may exist on several segments)."""
        owners = [(i, p) for i, p, ps in self.ports()
                  if (any(g == gid for g, _ in gid_table(ps, i, p)) if gid.strip("0:") else dlid and port_lid(i, p) == dlid)]
        if not owners:
            raise KeyError(gid or dlid)
        near = [o for o in owners if src is not None and self.reaches(src, sgid, o, gid)]
        return (near or owners)[0]

    def reaches(self, src: Tuple[int, int], sgid: str, dst: Tuple[int, int], dgid: str) -> bool:
        """Whether packets from port ``src`` (sent from ``sgid``) to port ``dst`` (at ``dgid``) and their ACKs
        arrive: on Ethernet, a link-local source or destination GID confines the exchange to the L2 segment
        (:attr:`PortSpec.segment`); anything else (routable GIDs, InfiniBand) reaches every port."""
        sps = self.spec.devices[src[0]].ports[src[1] - 1]
        dps = self.spec.devices[dst[0]].ports[dst[1] - 1]
        if sps.link_layer != "Ethernet" or not (is_link_local(sgid) or is_link_local(dgid)):
            return True
        return segment_of(sps, *src) == segment_of(dps, *dst)

    def pyverbs(self, devices: Optional[List[str]] = None) -> SimpleNamespace:
        """A pyverbs-like namespace seeing ``devices`` (names; None: all) -- one emulated host."""
        fab = self
        visible = list(devices) if devices is not None else [d.name for d in self.spec.devices]

        def get_device_list():
            return [SimpleNamespace(name=n.encode()) for n in visible]

        class Context(_Context):
            def __init__(self, name: str = "", **kw):
                if name not in visible:
                    raise PyverbsRDMAError(f"Failed to open device {name}", _errno.ENODEV)
                super().__init__(fab, name)

        return SimpleNamespace(
            name="emulated", enums=enums, get_device_list=get_device_list, Context=Context, PD=PD, MR=MR,
            CQ=CQ, QP=QP, QPInitAttr=QPInitAttr, QPCap=QPCap, QPAttr=QPAttr, AHAttr=AHAttr,
            GlobalRoute=GlobalRoute, GID=GID, SendWR=SendWR, RecvWR=RecvWR, SGE=SGE, DmaBufMR=None,
            Mlx5QP=Mlx5QP, PyverbsError=PyverbsError, PyverbsRDMAError=PyverbsRDMAError,
            PyverbsUserError=PyverbsUserError, fabric=fab)


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


# --------------------------------------------------------------------------------------------- records
_HDR = struct.Struct("<BBHIIQIQIIIIQIBBH")   # see _pack
_REQ, _ACK = 1, 2
_F_LAST = 1


def _pack(kind, opcode, flags, src, dst, seq, rkey=0, raddr=0, total=0, off=0, flen=0, imm=0, add=0,
          status=0, rnr_retry=0, timer=0, payload=b""):
    return _HDR.pack(kind, opcode, flags, src, dst, seq, rkey, raddr, total, off, flen, imm, add, status,
                     rnr_retry, timer, 0) + payload


class _Ring:
    """Single-producer single-consumer byte ring in a shared file; 8-byte head/tail counters. The consumer's
    process (the QP's, ``create``) holds a lock on the file's first byte while the QP exists; a producer keeps a
    descriptor of the file to ask whether that lock is still held (:meth:`consumer_alive`)."""
    DATA = 64

    def __init__(self, path: str, capacity: int, create: bool) -> None:
        self.path, self.cap, self.own = path, capacity, create
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.DATA + capacity)
                if liveness.supported():
                    liveness.lock_byte(fd, 0)
            self.mm = mmap.mmap(fd, self.DATA + capacity)
        except BaseException:
            os.close(fd)
            raise
        #: the file's descriptor (the consumer's holds the lock); None once closed
        self.fd: Optional[int] = fd
        self.wlock = threading.Lock()
        _open_rings.add(self)

    def consumer_alive(self) -> bool:
        """Whether the QP reading this ring still exists: its process holds the file's lock (always true for a
        ring of this process's own QP, or where locks are not supported)."""
        fd = self.fd
        if self.own or fd is None or not liveness.supported():
            return True
        try:
            return liveness.byte_locked(fd, 0)
        except OSError:
            return True

    def _get(self, off: int) -> int:
        return struct.unpack_from("<Q", self.mm, off)[0]

    def put(self, rec: bytes, assist, deadline: float) -> bool:
        """Append one record; while full, call ``assist()`` and retry until ``deadline`` (monotonic). Returns False
        where the ring's QP is gone (full, and its process's lock released): the record is dropped."""
        need = 8 + ((len(rec) + 7) & ~7)
        if need > self.cap // 2:
            raise PyverbsRDMAError("record larger than half the ring", _errno.EMSGSIZE)
        with self.wlock:
            while True:
                head, tail = self._get(0), self._get(8)
                pos = head % self.cap
                pad = self.cap - pos if pos + need > self.cap else 0
                if self.cap - (head - tail) >= need + pad:
                    break
                if not self.consumer_alive():
                    return False        # (its QP is gone: the packets are lost, as on a wire)
                if time.monotonic() > deadline:
                    raise PyverbsRDMAError(f"emulated link stalled: ring {self.path} full", _errno.ETIMEDOUT)
                assist()
                time.sleep(0.0001)
            if pad:
                struct.pack_into("<I", self.mm, self.DATA + pos, 0xFFFFFFFF)
                head += pad
                pos = 0
            struct.pack_into("<I", self.mm, self.DATA + pos + 4, 0)
            self.mm[self.DATA + pos + 8:self.DATA + pos + 8 + len(rec)] = rec
            struct.pack_into("<I", self.mm, self.DATA + pos, len(rec))
            struct.pack_into("<Q", self.mm, 0, head + need)
        return True

    def drain(self) -> List[bytes]:
        """Every complete record now in the ring, oldest first (consumer side)."""
        out = []
        head, tail = self._get(0), self._get(8)
        while tail < head:
            pos = tail % self.cap
            n = struct.unpack_from("<I", self.mm, self.DATA + pos)[0]
            if n == 0xFFFFFFFF:
                tail += self.cap - pos
                continue
            out.append(bytes(self.mm[self.DATA + pos + 8:self.DATA + pos + 8 + n]))
            tail += 8 + ((n + 7) & ~7)
        struct.pack_into("<Q", self.mm, 8, tail)
        return out

    def close(self, unlink: bool) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass
        self._close_fd()
        _open_rings.discard(self)
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass


    def _close_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


#: rings whose file this process holds open (a forked child closes its copies: it must not keep a dead parent's
#: QPs alive through their locks)
_open_rings: "weakref.WeakSet[_Ring]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ring in list(_open_rings):
        ring._close_fd()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _rnr_delay_s(timer: int) -> float:
    """Seconds of the IB ``min_rnr_timer`` encoding (0 means 655.36 ms; 1..31 grow from 0.01 ms)."""
    table = [655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28,
             1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84,
             245.76, 327.68, 491.52]
    return table[timer & 31] / 1000.0


# ---------------------------------------------------------------------------------------------- engine
class _Engine:
    """Per-process, per-fabric state and the progress thread that plays the HCAs' part."""
    _by_token: Dict[str, "_Engine"] = {}
    _glock = threading.Lock()

    @classmethod
    def get(cls, fabric: Fabric) -> "_Engine":
        with cls._glock:
            eng = cls._by_token.get(fabric.token)
            if eng is None or eng.pid != os.getpid():
                eng = cls._by_token[fabric.token] = _Engine(fabric)
            return eng

    def __init__(self, fabric: Fabric) -> None:
        self.fabric, self.pid = fabric, os.getpid()
        self.lock = threading.RLock()
        self.model = RateModel()
        self.qps: Dict[int, "QP"] = {}
        self.mrs: Dict[int, "MR"] = {}
        self.out_rings: Dict[int, _Ring] = {}
        self.qpn_next: Dict[int, int] = collections.defaultdict(lambda: 1)
        self.key_next = 0x100
        self.rng = random.Random(fabric.spec.reorder_seed)
        self.kick = threading.Event()
        #: QPs whose doorbell rang (:meth:`ring_doorbell`): the progress thread executes their work queue entries
        self.rung: collections.deque = collections.deque()
        self.thread: Optional[threading.Thread] = None
        #: (responder qpn, requester seq) of the latest placements, in placement order (for tests)
        self.placements: collections.deque = collections.deque(maxlen=1 << 16)

    def path(self, qpn: int) -> str:
        return f"{self.fabric.ring_prefix}{qpn:06x}"

    def release_if_idle(self) -> None:
        """With no QP left in this process: unmap the peers' rings (each mapping holds a descriptor) and
        wait for the progress thread to stop (it stops by itself once idle without QPs)."""
        with self.lock:
            if self.qps:
                return
            rings, self.out_rings = list(self.out_rings.values()), {}
            thread = self.thread
        for r in rings:
            r.close(unlink=False)
        if thread is not None and thread is not threading.current_thread():
            self.kick.set()
            thread.join(timeout=5.0)

    def start(self) -> None:
        """Start the progress thread unless it runs."""
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="emulated-hca", daemon=True)
                self.thread.start()

    def new_qpn(self, dev_index: int) -> int:
        with self.lock:
            n = self.qpn_next[dev_index]
            self.qpn_next[dev_index] += 1
            if n >= 0x1000:
                raise PyverbsRDMAError("Failed to create QP: too many emulated QPs", _errno.ENOMEM)
            return ((dev_index + 1) << 12) | n

    def new_key(self) -> int:
        with self.lock:
            self.key_next += 0x101
            return self.key_next

    def out_ring(self, qpn: int) -> _Ring:
        r = self.out_rings.get(qpn)
        if r is None:
            own = self.qps.get(qpn)
            r = own.ring if own is not None else _Ring(self.path(qpn), self.fabric.spec.ring_bytes, create=False)
            self.out_rings[qpn] = r
        return r

    def send(self, qpn: int, rec: bytes, timeout_s: float = 60.0) -> None:
        """Put ``rec`` into QP ``qpn``'s inbound ring (outside the engine lock); dropped where that QP is gone
        (:meth:`_Ring.put`: its requester sees no ACK)."""
        self.out_ring(qpn).put(rec, self.drain, time.monotonic() + timeout_s)
        self.kick.set()

    def look_at_peer(self, qp: "QP", now: float) -> None:
        """Every :data:`PEER_LOOK_S` while ``qp`` has requests outstanding: where the QP they went to is gone (its
        process's lock on its ring released), they are lost from now on (:meth:`QP._lost` fails the oldest after
        the retry time). Called by the progress thread, under the engine lock."""
        if now < qp.peer_look_at or qp.peer_gone or qp.dst is None:
            return
        qp.peer_look_at = now + PEER_LOOK_S
        ring = self.out_rings.get(qp.dest_qpn)
        if ring is not None and not ring.consumer_alive():
            qp.peer_gone = True
            if qp.outstanding:
                qp.lost_since = qp.lost_since or now

    def ring_doorbell(self, qp: "QP") -> None:
        """``qp`` has work queue entries to execute (:meth:`QP.post_send`): wake the progress thread."""
        self.rung.append(qp)
        if not self.kick.is_set():
            self.kick.set()

    # ---- progress
    def execute(self) -> bool:
        """Execute the work queue entries of every QP whose doorbell rang, in post order per QP (each under the
        engine lock, its records sent outside it); returns whether there were any."""
        rung, did = self.rung, False
        while rung:
            qp = rung.popleft()
            bell = qp.doorbell
            while bell:
                with self.lock:
                    if not bell:        # (a RESET emptied it)
                        break
                    recs = qp._start(bell.popleft())
                did = True
                for rec in recs:
                    self.send(qp.dest_qpn, rec)
        return did

    def drain(self) -> None:
        """Move every inbound record into its QP's pending queue (never blocks)."""
        with self.lock:
            now = time.monotonic()
            for qp in list(self.qps.values()):
                if qp.ring is None:
                    continue
                for rec in qp.ring.drain():
                    if rec[0] == _ACK:
                        qp.acks.append(rec)
                        continue
                    spec, hold = self.fabric.spec, now
                    if spec.reorder_seed is not None:
                        hold += self.rng.random() * spec.reorder_max_s
                    if spec.skew_s and qp.qp_num % 2 == 0:
                        hold += spec.skew_s
                    if hold != now:
                        hold = qp.last_hold = max(qp.last_hold, hold)
                    qp.pending.append([hold, rec])

    def step(self) -> bool:
        """One pass: execute posted requests, drain, then handle every ready record; returns whether anything
        happened."""
        did = self.execute()
        self.drain()
        outgoing: List[Tuple[int, bytes]] = []
        with self.lock:
            now = time.monotonic()
            for qp in list(self.qps.values()):
                if qp.outstanding:
                    self.look_at_peer(qp, now)
                qp._lost(now)
                while qp.acks:
                    qp._on_ack(qp.acks.popleft())
                    did = True
                while qp.pending and qp.pending[0][0] <= now:
                    rec = qp.pending[0][1]
                    res = qp._on_request(rec, now)
                    if res is None:          # waiting (RNR / not yet RTR): keep order, retry later
                        break
                    qp.pending.popleft()
                    did = True
                    if res:
                        outgoing.append(res)
        for qpn, rec in outgoing:
            self.send(qpn, rec)
        return did

    def _run(self) -> None:
        idle = 0
        while True:
            self.kick.clear()       # (before the step: a doorbell rung during it ends the wait below at once)
            try:
                did = self.step()
            except Exception as ex:  # keep the emulated HCA alive; surface through the QPs
                with self.lock:
                    for qp in self.qps.values():
                        qp.async_error = qp.async_error or repr(ex)
                did = False
            if did:
                idle = 0
                continue
            idle = min(idle + 1, 20)
            if idle == 20:
                with self.lock:
                    if not self.qps:        # nothing left to serve: stop; the next QP restarts the thread
                        self.thread = None
                        return
            self.kick.wait(0.00005 * idle)


# ----------------------------------------------------------------------------------------------- verbs
class _Context:
    """``ibv_context`` of an emulated device."""

    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric, self.name = fabric, name
        self.dev_index = fabric.device_index(name)
        self.spec = fabric.spec.devices[self.dev_index]
        self.engine = fabric.engine

    def query_device(self) -> SimpleNamespace:
        """Device attributes: ports, limits, vendor (Mellanox's id for ``mlx5_*`` names)."""
        mlx = self.name.startswith("mlx5")
        return SimpleNamespace(phys_port_cnt=len(self.spec.ports), max_qp_wr=32768, max_cqe=4194303,
                               max_qp=4095, max_sge=30, max_mr_size=1 << 48, fw_ver="emulated", max_qp_rd_atom=16,
                               vendor_id=0x02C9 if mlx else 0, vendor_part_id=4129 if mlx else 0,
                               atomic_cap=1)

    def _port(self, port_num: int) -> PortSpec:
        if not 1 <= port_num <= len(self.spec.ports):
            raise PyverbsRDMAError(f"Failed to query port {port_num}", _errno.EINVAL)
        return self.spec.ports[port_num - 1]

    def query_port(self, port_num: int) -> SimpleNamespace:
        """Port attributes: state, link layer, speed/width codes, active MTU (``PortSpec.active_mtu`` as an
        ``IBV_MTU_*`` code; max MTU 4096), LID, GID table length."""
        ps = self._port(port_num)
        speed, width = _speed_codes(ps.speed_gbps)
        ib = ps.link_layer == "InfiniBand"
        return SimpleNamespace(state=E.IBV_PORT_ACTIVE if ps.active else E.IBV_PORT_DOWN,
                               link_layer=E.IBV_LINK_LAYER_INFINIBAND if ib else E.IBV_LINK_LAYER_ETHERNET,
                               active_speed=speed, active_width=width, active_mtu=mtu_code(ps),
                               max_mtu=E.IBV_MTU_4096, lid=port_lid(self.dev_index, port_num) if ib else 0,
                               gid_tbl_len=len(self._gids(port_num)))

    def _gids(self, port_num: int):
        return gid_table(self._port(port_num), self.dev_index, port_num)

    def query_gid(self, port_num: int, index: int) -> GID:
        """GID ``index`` of port ``port_num``."""
        g = self._gids(port_num)
        if not 0 <= index < len(g):
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {port_num}", _errno.EINVAL)
        return GID(g[index][0])

    def query_gid_type(self, port_num: int, index: int) -> int:
        """Sysfs GID type (0: IB/RoCEv1, 1: RoCEv2) of GID ``index``."""
        g = self._gids(port_num)
        if not 0 <= index < len(g):
            raise PyverbsRDMAError(f"Failed to query gid type {index}", _errno.EINVAL)
        return g[index][1]

    def close(self) -> None:
        """Nothing to release."""


def _speed_codes(gbps: float) -> Tuple[int, int]:
    """(active_speed, active_width) codes whose product is ``gbps`` (4x lanes of the matching rate)."""
    for code, lane in ((256, 200.0), (128, 100.0), (64, 50.0), (32, 25.0), (16, 14.0), (4, 10.0), (2, 5.0)):
        if abs(gbps - 4 * lane) < 1e-6:
            return code, 2
    return 32, 2


class PD:
    """``ibv_pd``: groups MRs and QPs; a QP may only access MRs of its own PD."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx

    def close(self) -> None:
        """Nothing to release."""


class MR:
    """``ibv_mr``: host memory registered for local and remote access.

    ``MR(pd, length, access)`` allocates ``length`` bytes; ``MR(pd, length, access, address=a)`` registers
    existing memory at ``a`` (this process's).  ``.buf`` is the address, ``.lkey``/``.rkey`` the keys.
    """

    def __init__(self, pd: PD, length: int, access: int, address: Optional[int] = None, **kw) -> None:
        if length <= 0:
            raise PyverbsRDMAError("Failed to register a MR", _errno.EINVAL)
        if (access & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_ATOMIC)) and not access & E.IBV_ACCESS_LOCAL_WRITE:
            raise PyverbsRDMAError("Failed to register a MR: remote write needs local write", _errno.EINVAL)
        self.pd, self.length, self.access = pd, length, access
        self._owned = None
        if address is None:
            self._owned = (ctypes.c_char * length)()
            address = ctypes.addressof(self._owned)
        self.buf = address
        eng = pd.ctx.engine
        self.lkey = self.rkey = eng.new_key()
        with eng.lock:
            eng.mrs[self.lkey] = self

    def read(self, length: int, offset: int) -> bytes:
        """``length`` bytes at ``offset`` of the region."""
        return ctypes.string_at(self.buf + offset, length)

    def write(self, data: bytes, length: int, offset: int = 0) -> None:
        """Copy ``data[:length]`` to ``offset`` of the region."""
        ctypes.memmove(self.buf + offset, bytes(data[:length]), length)

    def close(self) -> None:
        """Deregister: the keys stop working."""
        with self.pd.ctx.engine.lock:
            self.pd.ctx.engine.mrs.pop(self.lkey, None)


class CQ:
    """``ibv_cq`` of ``cqe`` entries; ``poll(n)`` returns ``(npolled, [WC])``; overrun raises on poll."""

    def __init__(self, ctx: _Context, cqe: int, cq_context=None, channel=None, comp_vector: int = 0) -> None:
        self.ctx, self.cqe = ctx, cqe
        self.q: collections.deque = collections.deque()
        self.overrun = False
        self.lock = threading.Lock()

    def _push(self, wc: WC) -> None:
        with self.lock:
            if len(self.q) >= self.cqe:
                self.overrun = True
                return
            self.q.append(wc)

    def poll(self, num_entries: int = 1) -> Tuple[int, List[WC]]:
        """Take up to ``num_entries`` completions; polling a send completion frees send-queue slots."""
        q = self.q
        if not q and not self.overrun:      # (an empty CQ: no lock, as a provider reads the next CQE's owner bit)
            return 0, []
        with self.lock:
            if self.overrun:
                raise PyverbsRDMAError("Failed to poll CQ: CQ overrun", _errno.EOVERFLOW)
            if len(q) <= num_entries:
                out = list(q)
                q.clear()
            else:
                out = [q.popleft() for _ in range(num_entries)]
            n = len(out)
        if n == 1:
            if out[0]._retire is not None:
                out[0]._retire[0]._retire(out[0]._retire[1])
        elif n:
            last = {}       # per QP its latest send completion: it frees every slot up to it (one retirement each)
            for wc in out:
                if wc._retire is not None:
                    last[wc._retire[0]] = wc._retire[1]
            for qp, seq in last.items():
                qp._retire(seq)
        return n, out

    def close(self) -> None:
        """Nothing to release."""


class Mlx5QP:
    """The two mlx5 direct-verbs calls the backend uses, as static methods (pyverbs' ``Mlx5QP``)."""

    @staticmethod
    def modify_udp_sport(qp: "QP", udp_sport: int) -> None:
        """Force the RoCEv2 UDP source port of a QP in RTS (``mlx5dv_modify_qp_udp_sport``)."""
        if not qp.ctx.name.startswith("mlx5"):
            raise PyverbsRDMAError("Failed to modify UDP sport: not an mlx5 device", _errno.EOPNOTSUPP)
        if qp.state != E.IBV_QPS_RTS:
            raise PyverbsRDMAError("Failed to modify UDP sport: QP not in RTS", _errno.EINVAL)
        qp.forced_sport = udp_sport

    @staticmethod
    def modify_lag_port(qp: "QP", port_num: int) -> None:
        """Steer a QP of a bonded mlx5 device to LAG port ``port_num`` (``mlx5dv_modify_qp_lag_port``)."""
        ps = qp.ctx.spec.ports[qp.port - 1]
        if not qp.ctx.name.startswith("mlx5") or not ps.lag_ports:
            raise PyverbsRDMAError("Failed to modify lag port: device is not bonded", _errno.EOPNOTSUPP)
        if not 1 <= port_num <= ps.lag_ports:
            raise PyverbsRDMAError(f"Failed to modify lag port {port_num}", _errno.EINVAL)
        qp.lag_port = port_num


_TRANSITIONS = {E.IBV_QPS_RESET: {E.IBV_QPS_INIT}, E.IBV_QPS_INIT: {E.IBV_QPS_INIT, E.IBV_QPS_RTR},
                E.IBV_QPS_RTR: {E.IBV_QPS_RTS}, E.IBV_QPS_RTS: {E.IBV_QPS_RTS}}


class QP:
    """An RC ``ibv_qp``: state machine RESET -> INIT -> RTR -> RTS (any -> ERR/RESET), post_send, post_recv.

    After RTR, ``ah`` is a copy of the ``AHAttr`` it was given (SL, traffic class, flow label, GIDs, as an HCA
    keeps them) and ``dst`` the (device index, port) its packets reach, None when they reach nothing.
    """

    def __init__(self, pd: PD, init_attr: QPInitAttr, qp_attr: Optional[QPAttr] = None) -> None:
        if init_attr.qp_type != E.IBV_QPT_RC:
            raise PyverbsRDMAError("Failed to create QP: only RC is emulated", _errno.EOPNOTSUPP)
        if init_attr.send_cq is None or init_attr.recv_cq is None:
            raise PyverbsRDMAError("Failed to create QP: missing CQ", _errno.EINVAL)
        self.pd, self.ctx = pd, pd.ctx
        self.engine = eng = pd.ctx.engine
        self.scq, self.rcq = init_attr.send_cq, init_attr.recv_cq
        self.cap = init_attr.cap
        self.sq_sig_all = init_attr.sq_sig_all
        self.qp_num = eng.new_qpn(self.ctx.dev_index)
        self.qp_type = E.IBV_QPT_RC
        self.state = E.IBV_QPS_RESET
        self.port, self.access, self.mtu = 1, 0, E.IBV_MTU_1024
        self.dest_qpn, self.ah, self.dst = 0, None, None
        self.min_rnr_timer, self.rnr_retry, self.retry_cnt, self.timeout = 0, 0, 0, 0
        self.forced_sport, self.lag_port = 0, 0
        self._route: Optional[tuple] = None
        self.seq = 0
        self.outstanding: "collections.OrderedDict[int, dict]" = collections.OrderedDict()
        self.sq: collections.deque = collections.deque()   # seqs occupying send-queue slots
        #: work queue entries posted and not yet executed by the progress thread (:meth:`post_send`)
        self.doorbell: "collections.deque[_WQE]" = collections.deque()
        self.rq: collections.deque = collections.deque()   # posted receive wr_ids
        self.pending: collections.deque = collections.deque()   # [hold-until, request record]
        self.acks: collections.deque = collections.deque()
        self.early_since: Optional[float] = None
        self.last_hold = 0.0
        self.rnr: Optional[dict] = None
        self.lost_since: Optional[float] = None   # post time of the oldest request to an unreachable destination
        #: the destination QP is gone (its process ended, or it was destroyed: :meth:`_Engine.look_at_peer`), and
        #: when the progress thread looks at it next
        self.peer_gone, self.peer_look_at = False, 0.0
        self.async_error: Optional[str] = None
        self.send_lock = threading.Lock()
        self.ring = _Ring(eng.path(self.qp_num), eng.fabric.spec.ring_bytes, create=True)
        _created_rings.add(self.ring.path)
        with eng.lock:
            eng.qps[self.qp_num] = self
        eng.start()          # the progress thread runs while this process has QPs
        eng.start()

    @property
    def qp_state(self) -> int:
        """Current state (``IBV_QPS_*``)."""
        return self.state

    # ---- state transitions
    def _move(self, attr: QPAttr, new: int) -> None:
        if new not in _TRANSITIONS.get(self.state, ()):
            raise PyverbsRDMAError(f"Failed to modify QP state to {new} from {self.state}", _errno.EINVAL)
        if new == E.IBV_QPS_INIT:
            ports = self.ctx.spec.ports
            if not 1 <= attr.port_num <= len(ports):
                raise PyverbsRDMAError(f"Failed to modify QP to INIT: bad port {attr.port_num}", _errno.EINVAL)
            self.port, self.access = attr.port_num, attr.qp_access_flags
        elif new == E.IBV_QPS_RTR:
            self._rtr(attr)
        elif new == E.IBV_QPS_RTS:
            self.retry_cnt, self.rnr_retry, self.timeout = attr.retry_cnt, attr.rnr_retry, attr.timeout
        self.state = new

    def _rtr(self, attr: QPAttr) -> None:
        """Check and keep the RTR attributes (``ibv_modify_qp`` to RTR; the checks of the verbs spec, 11.2.5).

        Raises ``PyverbsRDMAError``: EINVAL for no address or destination QPN, a bad ``sgid_index``, an SL
        outside 0..15 or a traffic class outside 0..255, or a path MTU that is not an ``IBV_MTU_*`` code or is
        above the local or the remote port's active MTU; EHOSTUNREACH for a routable destination GID (or LID)
        that no port owns (the kernel's neighbour resolution fails at RTR).  A link-local destination is not
        resolved (the kernel derives its MAC from the GID), so an unreachable one -- on another L2 segment, or
        nowhere -- passes RTR and the first send ends in ``IBV_WC_RETRY_EXC_ERR`` (:meth:`_lost`).
        """
        ah = attr.ah_attr
        if ah is None or not attr.dest_qp_num:
            raise PyverbsRDMAError("Failed to modify QP to RTR: no address or dest QPN", _errno.EINVAL)
        own = self.ctx._gids(self.port)
        if ah.is_global and not 0 <= ah.sgid_index < len(own):
            raise PyverbsRDMAError(f"Failed to modify QP to RTR: bad sgid_index {ah.sgid_index}", _errno.EINVAL)
        if not 0 <= ah.sl <= 15 or (ah.is_global and not 0 <= ah.traffic_class <= 255):
            raise PyverbsRDMAError(f"Failed to modify QP to RTR: bad sl {ah.sl} or traffic_class "
                                   f"{ah.traffic_class}", _errno.EINVAL)
        fab, src = self.engine.fabric, (self.ctx.dev_index, self.port)
        sgid, dgid = (own[ah.sgid_index][0], ah.dgid) if ah.is_global else ("", "")
        ps = self.ctx.spec.ports[self.port - 1]
        try:
            dst = fab.resolve(dgid, ah.dlid, src, sgid)
        except KeyError:
            if not (ps.link_layer == "Ethernet" and is_link_local(dgid)):
                raise PyverbsRDMAError("Failed to modify QP to RTR: destination unreachable",
                                       _errno.EHOSTUNREACH) from None
            dst = None
        if dst is not None and not (fab.reaches(src, sgid, dst, dgid) and (attr.dest_qp_num >> 12) - 1 == dst[0]):
            dst = None        # another segment, or a QPN the port at that GID does not have: packets are lost
        limit = min([mtu_code(ps)] + ([mtu_code(fab.spec.devices[dst[0]].ports[dst[1] - 1])] if dst else []))
        if not E.IBV_MTU_256 <= attr.path_mtu <= limit:
            raise PyverbsRDMAError(f"Failed to modify QP to RTR: path_mtu {attr.path_mtu} above the active MTU "
                                   f"({limit}) of this or the remote port", _errno.EINVAL)
        self.ah, self.dst, self.dest_qpn = copy.copy(ah), dst, attr.dest_qp_num
        self.mtu, self.min_rnr_timer, self.lost_since = attr.path_mtu, attr.min_rnr_timer, None
        self.peer_gone, self.peer_look_at = False, 0.0
        if dst is not None:
            try:        # map the peer's inbound ring now, so that its owner may unlink the file (Fabric.unlink_rings)
                self.engine.out_ring(self.dest_qpn)
            except OSError:
                pass    # not created yet: mapped on the first send, as before

    def retry_time_s(self) -> float:
        """Seconds before a request that is never acknowledged fails: (``retry_cnt`` + 1) local ACK timeouts of
        4.096 us * 2 ** ``timeout`` (IB encoding; ``timeout`` 0 means wait forever: ``inf``)."""
        return float("inf") if not self.timeout else (self.retry_cnt + 1) * 4.096e-6 * (1 << self.timeout)

    def _lost(self, now: float) -> None:
        """Called by the progress thread: once the oldest request to an unreachable destination has waited
        :meth:`retry_time_s`, it completes with ``IBV_WC_RETRY_EXC_ERR`` and the QP moves to ERR."""
        if self.lost_since is not None and self.outstanding and now >= self.lost_since + self.retry_time_s():
            self.lost_since = None
            self._error(next(iter(self.outstanding)), E.IBV_WC_RETRY_EXC_ERR)

    def to_init(self, attr: QPAttr) -> None:
        """RESET -> INIT: port, access flags (remote write / atomic allowed as responder)."""
        self._move(attr, E.IBV_QPS_INIT)

    def to_rtr(self, attr: QPAttr) -> None:
        """(RESET ->) INIT -> RTR: destination address (GID/LID), dest QPN, MTU, min RNR timer."""
        if self.state == E.IBV_QPS_RESET:
            self.to_init(attr)
        self._move(attr, E.IBV_QPS_RTR)

    def to_rts(self, attr: QPAttr) -> None:
        """(-> RTR) -> RTS: retry counts and timeout; the QP may now send."""
        if self.state in (E.IBV_QPS_RESET, E.IBV_QPS_INIT):
            self.to_rtr(attr)
        self._move(attr, E.IBV_QPS_RTS)

    def modify(self, attr: QPAttr, comp_mask: int = 0) -> None:
        """Only moves to ERR or RESET are emulated here (the backend uses to_init/to_rtr/to_rts)."""
        if attr.qp_state == E.IBV_QPS_ERR:
            with self.engine.lock:
                self._to_error()
        elif attr.qp_state == E.IBV_QPS_RESET:
            with self.send_lock, self.engine.lock:     # (the order _post_send takes them in; _retire: send lock)
                self.state, self.lost_since = E.IBV_QPS_RESET, None
                for q in (self.outstanding, self.sq, self.doorbell, self.rq, self.pending, self.acks):
                    q.clear()
        else:
            self._move(attr, attr.qp_state)

    # ---- requester
    def _path_resources(self) -> Tuple[list, tuple]:
        """Rate-model resources and (UDP sport, path) of this QP; cached until the route changes."""
        key = (self.forced_sport, self.lag_port, self.dest_qpn, id(self.ah))
        if self._route is None or self._route[0] != key:
            self._route = (key, self._compute_route())
        return self._route[1]

    def _compute_route(self) -> Tuple[list, tuple]:
        fab = self.engine.fabric
        ps = self.ctx.spec.ports[self.port - 1]
        src_gid = self.ctx._gids(self.port)[self.ah.sgid_index if self.ah.is_global else 0][0]
        dst_gid = self.ah.dgid if self.ah.is_global else ""
        sport = topology.effective_udp_sport(self.ah.flow_label if self.ah.is_global else 0,
                                             self.qp_num, self.dest_qpn, self.forced_sport)
        path = topology.emulator_path_hash(src_gid, dst_gid, sport, fab.spec.n_paths)
        lag = self.lag_port or ((self.qp_num % ps.lag_ports) + 1 if ps.lag_ports else 0)
        dd, dp = self.dst
        dps = fab.spec.devices[dd].ports[dp - 1]
        res = [(("tx", self.ctx.dev_index, self.port, lag), ps.speed_gbps * 1e9 / 8),
               # links are full duplex: a path carries each direction at its own rate
               (("path", path, self.ctx.dev_index < dd), fab.spec.path_gbps * 1e9 / 8),
               (("rx", dd, dp), dps.speed_gbps * max(1, dps.lag_ports) * 1e9 / 8)]
        return res, (sport, path)

    def flow(self) -> Tuple[int, int]:
        """(UDP source port, fabric path) this QP's packets use (after RTR)."""
        return self._path_resources()[1]

    def post_send(self, wr: SendWR, bad_wr=None) -> None:
        """Post a chain of send WRs (``next_wr``): a doorbell, as on a NIC. Each request takes a send-queue slot and
        its fields (and its SGEs' addresses, lengths and keys) are copied into a work queue entry, as a provider
        library writes a WQE; the progress thread then executes it, as the HCA does after the doorbell: it checks the
        keys, reads the payload (so, as on a NIC, the source memory must stay as it is until the request completes),
        charges the rate model and sends the records. Raises ENOMEM on a full send queue (the requests before the
        one that did not fit stay posted), EINVAL before RTS. Its CPU time counts in :func:`nic_cpu_s`."""
        _counting_nic_cpu(self._post_send, wr)

    def _post_send(self, wr: SendWR) -> None:
        if self.state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
            raise PyverbsRDMAError(f"Failed to post send: QP {self.qp_num} not in RTS", _errno.EINVAL)
        if self.state == E.IBV_QPS_ERR:
            with self.send_lock, self.engine.lock:      # (in ERR the requests flush at once: nothing to execute)
                self._flush_posted(wr)
            return
        full = None
        sig_all, sig = self.sq_sig_all, E.IBV_SEND_SIGNALED
        with self.send_lock:
            sq, bell, depth = self.sq, self.doorbell, self.cap.max_send_wr
            while wr is not None:
                if len(sq) >= depth:   # WRs before this one stay posted, as in verbs
                    full = PyverbsRDMAError("Failed to post send", _errno.ENOMEM)
                    break
                self.seq = seq = self.seq + 1
                sq.append(seq)
                bell.append(_WQE(seq, wr.wr_id, wr.opcode, bool(sig_all or wr.send_flags & sig), wr.imm_data, wr.rkey,
                                 wr.remote_addr, wr.compare_add, tuple((g.addr, g.length, g.lkey) for g in wr._sg)))
                wr = wr._next
        if bell:
            self.engine.ring_doorbell(self)
        if full is not None:
            raise full

    def _flush_posted(self, wr: SendWR) -> None:
        """Post the chain ``wr`` on a QP in ERR (under its send lock and the engine lock): each request completes at
        once with ``IBV_WC_WR_FLUSH_ERR``."""
        while wr is not None:
            if len(self.sq) >= self.cap.max_send_wr:
                raise PyverbsRDMAError("Failed to post send", _errno.ENOMEM)
            self.seq += 1
            self.sq.append(self.seq)
            self._start(_WQE(self.seq, wr.wr_id, wr.opcode, bool(self.sq_sig_all or wr.send_flags & E.IBV_SEND_SIGNALED),
                             0, 0, 0, 0, ()))
            wr = wr._next

    def _start(self, w: "_WQE") -> List[bytes]:
        """Execute work queue entry ``w`` (the progress thread, under the engine lock): its records to send."""
        seq = w.seq
        wc_op = E.IBV_WC_FETCH_ADD if w.opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD else E.IBV_WC_RDMA_WRITE
        ent = {"wr_id": w.wr_id, "signaled": w.signaled, "op": wc_op, "result": None}
        self.outstanding[seq] = ent
        if self.state != E.IBV_QPS_RTS:
            self._complete(seq, E.IBV_WC_WR_FLUSH_ERR)
            return []
        addr, _, lkey = w.sges[0]
        mr = self.engine.mrs.get(lkey)
        total = sum(g[1] for g in w.sges)
        bad = mr is None or mr.pd is not self.pd or addr < mr.buf or addr + total > mr.buf + mr.length
        if w.opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            bad = bad or total != 8 or not (mr.access & E.IBV_ACCESS_LOCAL_WRITE)
        elif w.opcode not in (E.IBV_WR_RDMA_WRITE, E.IBV_WR_RDMA_WRITE_WITH_IMM):
            self._error(seq, E.IBV_WC_LOC_QP_OP_ERR)
            return []
        if bad and total:
            self._error(seq, E.IBV_WC_LOC_PROT_ERR)
            return []
        if self.dst is None or self.peer_gone:    # unreachable or gone: the packets go nowhere, no ACK comes back
            self.lost_since = self.lost_since or time.monotonic()
            return []
        res, _ = self._path_resources()
        self.engine.model.charge(("qp", self.ctx.dev_index, self.qp_num), res, total)
        if w.opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            ent["result"] = addr
            return [_pack(_REQ, w.opcode, _F_LAST, self.qp_num, self.dest_qpn, seq, w.rkey, w.remote_addr,
                          8, 0, 0, 0, w.compare_add & ((1 << 64) - 1), 0, self.rnr_retry)]
        data = b"".join(ctypes.string_at(a, n) for a, n, _ in w.sges)
        frag = max(4096, self.engine.fabric.spec.ring_bytes // 4 - _HDR.size - 64)
        recs = []
        off = 0
        while True:
            piece = data[off:off + frag]
            last = off + len(piece) >= total
            recs.append(_pack(_REQ, w.opcode, _F_LAST if last else 0, self.qp_num, self.dest_qpn, seq, w.rkey,
                              w.remote_addr, total, off, len(piece), w.imm & 0xFFFFFFFF, 0, 0,
                              self.rnr_retry, 0, piece))
            off += len(piece)
            if last:
                return recs

    def _complete(self, seq: int, status: int) -> None:
        """Finish requester WR ``seq``: completion if signalled or failed."""
        ent = self.outstanding.pop(seq, None)
        if ent is None:
            return
        if ent["signaled"] or status != E.IBV_WC_SUCCESS:
            wc = WC(ent["wr_id"], status, ent["op"], self.qp_num, 8 if ent["op"] == E.IBV_WC_FETCH_ADD else 0)
            wc._retire = (self, seq)
            self.scq._push(wc)

    def _retire(self, seq: int) -> None:
        # (under the QP's send lock, not the engine's, which the progress thread holds while it places payloads)
        with self.send_lock:
            sq = self.sq
            while sq and sq[0] <= seq:
                sq.popleft()

    def _error(self, seq: int, status: int) -> None:
        self._complete(seq, status)
        self._to_error()

    def _to_error(self) -> None:
        """Enter ERR: flush every outstanding send and posted receive (completions always generated)."""
        self.state = E.IBV_QPS_ERR
        for s in list(self.outstanding):
            self._complete(s, E.IBV_WC_WR_FLUSH_ERR)
        while self.rq:
            self.rcq._push(WC(self.rq.popleft(), E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, self.qp_num))

    def _on_ack(self, rec: bytes) -> None:
        h = _HDR.unpack_from(rec)
        seq, status, value = h[5], h[13], h[12]
        if seq not in self.outstanding:
            return
        ent = self.outstanding[seq]
        if status == E.IBV_WC_SUCCESS and ent["result"] is not None:
            ctypes.memmove(ent["result"], struct.pack("<Q", value), 8)
        if status != E.IBV_WC_SUCCESS:
            self._error(seq, status)
        else:
            self._complete(seq, status)

    # ---- responder
    def _on_request(self, rec: bytes, now: float):
        """Handle one request record; None: not yet (keep it queued); b'' or (qpn, ack): done."""
        (_, opcode, flags, src, _, seq, rkey, raddr, total, off, flen, imm, add, _, rnr_retry, _, _) = \
            _HDR.unpack_from(rec)
        last = flags & _F_LAST

        def reply(status: int, value: int = 0):
            return (src, _pack(_ACK, opcode, 0, self.qp_num, src, seq, add=value, status=status))

        if self.state in (E.IBV_QPS_RESET, E.IBV_QPS_INIT):   # not ready: the requester would retry
            self.early_since = self.early_since or now
            return None if now < self.early_since + 5.0 else reply(E.IBV_WC_RETRY_EXC_ERR)
        self.early_since = None
        if self.state == E.IBV_QPS_ERR:
            return reply(E.IBV_WC_RETRY_EXC_ERR) if last else b""
        if opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM and last and not self.rq:
            st = self.rnr
            if st is None or st["seq"] != seq:
                st = self.rnr = {"seq": seq, "tries": 0, "next": now}
            if now < st["next"]:
                return None
            if rnr_retry != 7 and st["tries"] >= rnr_retry:
                self.rnr = None
                return reply(E.IBV_WC_RNR_RETRY_EXC_ERR)
            st["tries"] += 1
            st["next"] = now + _rnr_delay_s(self.min_rnr_timer)
            return None
        self.rnr = None
        mr = self.engine.mrs.get(rkey)
        if opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            if raddr % 8:
                return self._remote_error(reply, E.IBV_WC_REM_INV_REQ_ERR)
            need = E.IBV_ACCESS_REMOTE_ATOMIC
            length = 8
        else:
            need = E.IBV_ACCESS_REMOTE_WRITE
            length = total
        if length and (mr is None or mr.pd is not self.pd or not (mr.access & need) or not (self.access & need)
                       or raddr < mr.buf or raddr + length > mr.buf + mr.length):
            return self._remote_error(reply, E.IBV_WC_REM_ACCESS_ERR)
        if opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            old = struct.unpack("<Q", ctypes.string_at(raddr, 8))[0]
            ctypes.memmove(raddr, struct.pack("<Q", (old + add) & ((1 << 64) - 1)), 8)
            self.engine.placements.append((self.qp_num, seq))
            return reply(E.IBV_WC_SUCCESS, old)
        if flen:
            ctypes.memmove(raddr + off, rec[_HDR.size:_HDR.size + flen], flen)
        if not last:
            return b""
        self.engine.placements.append((self.qp_num, seq))
        if opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
            self.rcq._push(WC(self.rq.popleft(), E.IBV_WC_SUCCESS, E.IBV_WC_RECV_RDMA_WITH_IMM, self.qp_num,
                              total, imm, E.IBV_WC_WITH_IMM))
        return reply(E.IBV_WC_SUCCESS)

    def _remote_error(self, reply, status: int):
        self._to_error()
        return reply(status)

    def post_recv(self, wr: RecvWR, bad_wr=None) -> None:
        """Post a chain of receive WRs.  Raises EINVAL in RESET, ENOMEM on a full receive queue. Its CPU time
        counts in :func:`nic_cpu_s`."""
        _counting_nic_cpu(self._post_recv, wr)

    def _post_recv(self, wr: RecvWR) -> None:
        with self.engine.lock:
            while wr is not None:
                if self.state == E.IBV_QPS_RESET:
                    raise PyverbsRDMAError("Failed to post recv: QP in RESET", _errno.EINVAL)
                if self.state == E.IBV_QPS_ERR:
                    self.rcq._push(WC(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, self.qp_num))
                elif len(self.rq) >= self.cap.max_recv_wr:
                    raise PyverbsRDMAError("Failed to post recv", _errno.ENOMEM)
                else:
                    self.rq.append(wr.wr_id)
                wr = wr.next_wr
        self.engine.kick.set()

    def close(self) -> None:
        """Destroy the QP and its ring; the last QP of this process also releases the peers' rings it
        mapped and stops the progress thread."""
        with self.engine.lock:
            self.engine.qps.pop(self.qp_num, None)
            self.engine.out_rings.pop(self.qp_num, None)
        self.ring.close(unlink=True)
        _created_rings.discard(self.ring.path)
        self.engine.release_if_idle()


_created_rings: set = set()

#: CPU nanoseconds this process's threads spent inside the emulated NIC's posts (:func:`nic_cpu_s`)
_nic_cpu = [0]
_nic_cpu_lock = threading.Lock()


def _counting_nic_cpu(fn, *args) -> None:
    """``fn(*args)`` (a post), its CPU time counted in :func:`nic_cpu_s`."""
    c0 = time.thread_time_ns()
    try:
        fn(*args)
    finally:
        dt = time.thread_time_ns() - c0
        with _nic_cpu_lock:
            _nic_cpu[0] += dt


def nic_cpu_s() -> float:
    """CPU seconds this process's threads have spent inside the emulated NIC's ``post_send`` and ``post_recv``, since
    the process started: the doorbells (a work queue entry per request; the payload copies, records and rate model
    are the progress thread's, never the poster's) and the receives posted.

    Benchmarks subtract it from a proxy's CPU time to get the proxy's own cost (on a NIC a post is a doorbell write;
    the emulator's completions, polled by the proxy, are not counted here and stay in the proxy's figure). The two
    clock reads around each post are counted here too."""
    return _nic_cpu[0] / 1e9


@atexit.register
def _unlink_rings() -> None:
    """Remove the ring files of QPs this process created and never closed."""
    for path in list(_created_rings):
        try:
            os.unlink(path)
        except OSError:
            pass


__all__ = ["Fabric", "FabricSpec", "nic_cpu_s", "DeviceSpec", "PortSpec", "RateModel", "enums", "port_gids", "port_lid",
           "gid_table", "mtu_code", "segment_of", "is_link_local",
           "PyverbsError", "PyverbsRDMAError", "PyverbsUserError"]
