"""GPUs, NICs, ports, GIDs, and the plan of queue pairs over ports and fabric paths.

Pure functions and plain data: nothing here opens a device, so all of it is unit-tested on any machine.

The plan answers two questions for every peer:

1. *Which local port does queue pair ``i`` use?*  QPs are dealt round-robin over the active ports of the
   NICs nearest the GPU, so per-port counts differ by at most one (a dual-port HCA shows up as two
   devices, or as one device with two ports, or as one bonded device whose LAG ports are selected per
   QP; all three reduce to a list of :class:`PortRef`).
2. *Which fabric path does it take?*  On RoCEv2 a switch picks an ECMP path by hashing the packet's
   5-tuple, whose only free field is the UDP source port.  The vendor-neutral way to choose that port is
   the GRH flow label: the Linux kernel derives the source port from it with
   :func:`flow_label_to_udp_sport` (``rdma_flow_label_to_udp_sport`` in ``include/rdma/ib_verbs.h``); when
   the flow label is 0 the kernel first derives a label from the two QP numbers
   (:func:`calc_flow_label`).  On mlx5 the source port may also be set directly after RTS
   (``mlx5dv_modify_qp_udp_sport``); the plan's source port is the same number either way.  Given a
   path-hash function (the switch's, or the emulator's), :func:`plan_flows` searches flow labels so that
   the QPs' path counts differ by at most one.
"""
from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

#: RoCEv2's UDP destination port (IANA); part of the 5-tuple switches hash.
ROCE_V2_UDP_DPORT = 4791
#: Lowest UDP source port a RoCEv2 sender uses (IB_ROCE_UDP_ENCAP_VALID_PORT_MIN in the kernel).
ROCE_SPORT_MIN = 0xC000
FLOW_LABEL_MASK = 0xFFFFF

#: ``path_hash(src_gid, dst_gid, udp_sport, n_paths) -> path index in [0, n_paths)``.
PathHash = Callable[[str, str, int, int], int]


class PlanError(ValueError):
    """The QP plan cannot be made (no active port, impossible path count, no flow label found)."""


def flow_label_to_udp_sport(flow_label: int) -> int:
    """UDP source port that a RoCEv2 sender derives from a 20-bit GRH flow label.

    Folds bits 14..19 onto bits 0..5 and sets the top two bits (result in [0xC000, 0xFFFF]), as the Linux
    kernel's ``rdma_flow_label_to_udp_sport`` does for every RoCEv2 driver.
    """
    fl = flow_label & FLOW_LABEL_MASK
    low, high = fl & 0x03FFF, fl & 0xFC000
    return ((low ^ (high >> 14)) | ROCE_SPORT_MIN) & 0xFFFF


def calc_flow_label(local_qpn: int, remote_qpn: int) -> int:
    """Flow label the kernel uses when the caller leaves it 0: a fold of ``lqpn * rqpn`` to 20 bits.

    Same formula as the kernel's ``rdma_calc_flow_label``; symmetric in the two QP numbers.
    """
    v = (local_qpn & 0xFFFFFF) * (remote_qpn & 0xFFFFFF)
    v ^= v >> 20
    v ^= v >> 40
    return v & FLOW_LABEL_MASK


def effective_udp_sport(flow_label: int, local_qpn: int, remote_qpn: int,
                        forced_sport: Optional[int] = None) -> int:
    """The UDP source port a RoCEv2 QP actually sends from.

    ``forced_sport`` (set through mlx5's direct source-port call) wins; otherwise the flow label decides,
    and a zero flow label is replaced by :func:`calc_flow_label` first.
    """
    if forced_sport:
        return forced_sport & 0xFFFF
    fl = flow_label & FLOW_LABEL_MASK or calc_flow_label(local_qpn, remote_qpn)
    return flow_label_to_udp_sport(fl)


def _gid_bytes(gid: str) -> bytes:
    """16 bytes of a GID written as 8 colon-separated hex groups (pyverbs' format) or any IPv6 form."""
    import ipaddress
    try:
        return ipaddress.IPv6Address(gid).packed
    except ValueError:
        return zlib.crc32(gid.encode()).to_bytes(4, "little") * 4


def emulator_path_hash(src_gid: str, dst_gid: str, udp_sport: int, n_paths: int) -> int:
    """The emulated fabric's ECMP choice: a splitmix64 mix of both GIDs and the source port, mod ``n_paths``."""
    x = int.from_bytes(_gid_bytes(src_gid)[8:], "little") * 0x9E3779B97F4A7C15
    x ^= int.from_bytes(_gid_bytes(dst_gid)[8:], "little") + (udp_sport << 17)
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x % n_paths


def crc_path_hash(src_gid: str, dst_gid: str, udp_sport: int, n_paths: int) -> int:
    """A switch-style ECMP hash: CRC-32 of the 5-tuple (src IP, dst IP, protocol 17, sport, dport 4791)."""
    tup = _gid_bytes(src_gid) + _gid_bytes(dst_gid) + struct.pack(">BHH", 17, udp_sport, ROCE_V2_UDP_DPORT)
    return zlib.crc32(tup) % n_paths


@dataclass(frozen=True)
class PortRef:
    """One usable NIC port as the plan sees it.

    Attributes:
        device: RDMA device name (``mlx5_0``, ``mlx5_bond_0``, ``emu0``).
        port: 1-based port number on that device.
        gid: the GID this port sends from (8 hex groups), used by the path hash.
        gid_index: index of ``gid`` in the port's GID table.
        active: port state is ACTIVE; inactive ports get no QPs.
        lag_port: for a bonded device, the physical LAG port (1-based) a QP is steered to; 0 otherwise.
        link_layer: ``"Ethernet"`` (RoCE) or ``"InfiniBand"``.
        speed_gbps: link speed in Gb/s (0 when unknown).
    """
    device: str
    port: int
    gid: str = ""
    gid_index: int = 0
    active: bool = True
    lag_port: int = 0
    link_layer: str = "Ethernet"
    speed_gbps: float = 0.0


@dataclass
class QPPlanEntry:
    """Where queue pair ``qp`` of one peer goes: port, flow label, source port and the path they hash to."""
    qp: int
    port: PortRef
    flow_label: int = 0
    udp_sport: int = 0
    path: Optional[int] = None


def spread_ports(num_qps: int, ports: Sequence[PortRef]) -> List[PortRef]:
    """Deal ``num_qps`` queue pairs round-robin over the active ports: per-port counts differ by <= 1.

    Raises:
        PlanError: no port is active, or ``num_qps < 1``.
    """
    active = [p for p in ports if p.active]
    if num_qps < 1:
        raise PlanError(f"num_qps_per_peer must be >= 1, got {num_qps}")
    if not active:
        raise PlanError("no active RDMA port: " + (", ".join(f"{p.device}:{p.port}" for p in ports) or "none"))
    return [active[i % len(active)] for i in range(num_qps)]


def plan_flows(entries: Sequence[QPPlanEntry], dst_gids: Sequence[str], n_paths: int,
               path_hash: PathHash = emulator_path_hash, seed: int = 0,
               max_tries: int = 1 << 16) -> List[QPPlanEntry]:
    """Give each QP a flow label (and so a UDP source port) that puts the QPs evenly on ``n_paths`` paths.

    QP ``i`` sends from ``entries[i].port.gid`` to ``dst_gids[i]``.  QPs are handled in order; each takes
    the least-used path (lowest index on ties) and the first flow label, searched deterministically from
    ``seed``, whose source port is unused and hashes to that path.  Resulting per-path counts differ by at
    most one whenever the hash can reach every path.  Entries are updated in place and returned.

    Raises:
        PlanError: ``n_paths < 1``, length mismatch, or no flow label within ``max_tries`` reaches the path.
    """
    if n_paths < 1:
        raise PlanError(f"n_paths must be >= 1, got {n_paths}")
    if len(dst_gids) != len(entries):
        raise PlanError(f"{len(entries)} QPs but {len(dst_gids)} destination GIDs")
    counts = [0] * n_paths
    used_sports: set = set()
    for i, e in enumerate(entries):
        target = min(range(n_paths), key=lambda p: (counts[p], p))
        start = (seed * 0x9E37 + i * 0x3F1 + 1) & FLOW_LABEL_MASK
        for k in range(max_tries):
            fl = (start + k * 0x1F3) & FLOW_LABEL_MASK or 1
            sport = flow_label_to_udp_sport(fl)
            if sport in used_sports:
                continue
            if path_hash(e.port.gid, dst_gids[i], sport, n_paths) == target:
                break
        else:
            raise PlanError(f"no flow label in {max_tries} tries puts QP {i} ({e.port.device}:{e.port.port}) "
                            f"on path {target} of {n_paths}")
        used_sports.add(sport)
        e.flow_label, e.udp_sport, e.path = fl, sport, target
        counts[target] += 1
    return list(entries)


def plan_peer(num_qps: int, ports: Sequence[PortRef], dst_gids: Optional[Sequence[str]] = None,
              n_paths: int = 0, path_hash: PathHash = emulator_path_hash, seed: int = 0) -> List[QPPlanEntry]:
    """The full plan for one peer: ports by :func:`spread_ports`, then flows by :func:`plan_flows`.

    With ``dst_gids`` None or ``n_paths`` 0 only ports are planned (flow label 0: the kernel's default).
    """
    entries = [QPPlanEntry(i, p) for i, p in enumerate(spread_ports(num_qps, ports))]
    if dst_gids is not None and n_paths > 0:
        plan_flows(entries, dst_gids, n_paths, path_hash, seed)
    return entries


def nics_near_gpu(gpu_pci: Optional[str], nic_pci: dict) -> List[str]:
    """NIC device names ordered nearest-first to a GPU by their sysfs PCI paths.

    Args:
        gpu_pci: the GPU's resolved sysfs device path (``/sys/devices/pci0000:00/.../0000:17:00.0``) or None.
        nic_pci: device name -> its resolved sysfs device path.
    Returns:
        Names sorted by the length of the PCI path they share with the GPU (longest first: same switch
        before same root complex before another socket), then by name.  Without a GPU path, by name.
    """
    def shared(p: str) -> int:
        if not gpu_pci or not p:
            return 0
        a, b = gpu_pci.split("/"), p.split("/")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    return sorted(nic_pci, key=lambda d: (-shared(nic_pci[d]), d))


def nearest_nics(gpu_pci: Optional[str], nic_pci: dict) -> List[str]:
    """The NICs that share the longest PCI path with the GPU (all of them, by name, without a GPU path)."""
    order = nics_near_gpu(gpu_pci, nic_pci)
    if not gpu_pci or not order:
        return order

    def shared(p: str) -> int:
        return len(os.path.commonpath([gpu_pci, p]).split("/")) if p else 0
    best = max(shared(nic_pci[d]) for d in order)
    return [d for d in order if shared(nic_pci[d]) == best]


def gpu_sysfs_path(index: int) -> Optional[str]:
    """Resolved sysfs PCI path of CUDA device ``index`` (via torch's PCI ids), or None where unknown."""
    try:
        import torch
        pr = torch.cuda.get_device_properties(index)
        bus = f"{pr.pci_domain_id:04x}:{pr.pci_bus_id:02x}:{pr.pci_device_id:02x}.0"
    except Exception:
        return None
    path = os.path.join("/sys/bus/pci/devices", bus)
    return os.path.realpath(path) if os.path.exists(path) else None


def sysfs_nic_pci_paths(root: str = "/sys/class/infiniband") -> dict:
    """Device name -> resolved sysfs PCI path for each RDMA device under ``root`` ({} where none)."""
    out = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for d in names:
        try:
            out[d] = os.path.realpath(os.path.join(root, d, "device"))
        except OSError:
            out[d] = ""
    return out


@dataclass
class PlanTable:
    """Rows of a printable table (list of equal-length string lists, header first)."""
    rows: List[List[str]] = field(default_factory=list)

    def render(self) -> str:
        """The table as aligned monospace text, one line per row."""
        if not self.rows:
            return ""
        w = [max(len(r[i]) for r in self.rows) for i in range(len(self.rows[0]))]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in self.rows]
        lines.insert(1, "  ".join("-" * x for x in w))
        return "\n".join(lines)


def plan_table(entries: Sequence[QPPlanEntry]) -> PlanTable:
    """A :class:`PlanTable` of a plan: qp, device, port, lag port, flow label, UDP sport, path."""
    t = PlanTable([["qp", "device", "port", "lag", "flow_label", "udp_sport", "path"]])
    for e in entries:
        t.rows.append([str(e.qp), e.port.device, str(e.port.port), str(e.port.lag_port or "-"),
                       f"0x{e.flow_label:05x}", str(e.udp_sport or "-"), "-" if e.path is None else str(e.path)])
    return t
