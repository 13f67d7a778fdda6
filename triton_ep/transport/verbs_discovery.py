"""Which RDMA devices, ports and GIDs a host has, for the verbs backend (:mod:`triton_ep.transport.verbs`): each
device opened briefly and described (:func:`discover`), the GID to send from (:func:`pick_gid`), and the active
ports as the QP plan's :class:`topology.PortRef` (:func:`ports_of`)."""
from __future__ import annotations

import ipaddress
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Sequence

from triton_ep.transport import topology
from triton_ep.transport.rdma import RdmaUnavailable
from triton_ep.transport.verbs_api import NO_DEVICE_HINT, _call, enums_of


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

