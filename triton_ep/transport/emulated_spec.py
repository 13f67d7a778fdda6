"""What the emulated fabric is made of (:mod:`triton_ep.transport.emulated`): the specs of its ports, devices and
paths, and the addressing they imply (GID tables, LIDs, active MTU codes, L2 segments)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from triton_ep.transport.emulated_api import E


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
