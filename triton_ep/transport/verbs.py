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

The backend's parts, each importable from here too: :mod:`~triton_ep.transport.verbs_api` (the pyverbs namespace, its
enums, the call wrapper), :mod:`~triton_ep.transport.verbs_discovery` (devices, ports, the GID to send from),
:mod:`~triton_ep.transport.verbs_qp` (QoS, QP attributes, work requests), :mod:`~triton_ep.transport.verbs_memory`
(registration) and :mod:`~triton_ep.transport.verbs_datapath` (post, poll, wait); this module opens the devices,
makes the QPs and connects them.
"""
from __future__ import annotations

import ctypes
import operator
import random
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

from triton_ep.transport import topology
from triton_ep.transport.rdma import Completion, QPInfo, RdmaError, RdmaUnavailable, Transport
# (every name below is also this module's, as before it was split)
from triton_ep.transport.verbs_api import (NEEDED_ENUMS, NO_DEVICE_HINT, WC_STATUS_NAMES, EnumShim, _call, enums_of,
                                           load_pyverbs)
from triton_ep.transport.verbs_datapath import _QP, _VerbsDataPath
from triton_ep.transport.verbs_discovery import (DeviceInfo, GidInfo, PortInfo, discover, pick_gid, ports_of,
                                                 speed_gbps)
from triton_ep.transport.verbs_memory import Region, _VerbsMemory
from triton_ep.transport.verbs_qp import QOS_ENV, QoS, build_init_attr, build_qp_attr, build_send_wr


def _checked_peers(peers: Sequence[int], rank: int, world_size: int) -> List[int]:
    """``peers`` as :class:`VerbsTransport` keeps them: sorted ints (numpy's included).

    Raises:
        TypeError: something other than int ranks (a ``bool`` included).
        ValueError: this rank, a rank outside ``0..world_size - 1``, or a rank twice.
    """
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
    return sorted(peers)


class VerbsTransport(_VerbsMemory, _VerbsDataPath, Transport):
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
            self.peers = _checked_peers(peers, rank, world_size)
        self.qos = QoS.resolve(traffic_class, service_level)
        self.api = api if api is not None else load_pyverbs()
        self.e = enums_of(self.api)
        self._wc_success = self.e.IBV_WC_SUCCESS        # (read per work completion: no enum look-up there)
        self._send_signaled = self.e.IBV_SEND_SIGNALED  # (stored per post)
        self._stamp = 0         # (numbers the calls of _link_prepared: a key met twice in one splits the chain)
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
        self._find_devices(devices, gpu, lag_ports)
        self._open_devices()
        for peer in self.peer_ranks():
            for i, port in enumerate(topology.spread_ports(num_qps_per_peer, self.ports)):
                self._create_qp(peer, i, port)

    # ---- setup
    def _find_devices(self, devices: Optional[Sequence[str]], gpu: Optional[int], lag_ports: Optional[int]) -> None:
        """The devices with an active port (``devices``; without them: the NICs nearest GPU ``gpu`` on real
        pyverbs, else all) and their active ports, as the constructor's arguments say."""
        if devices is None and gpu is not None and self.api.name == "pyverbs":
            near = topology.nearest_nics(topology.gpu_sysfs_path(gpu), topology.sysfs_nic_pci_paths())
            devices = near or None
        self.devices = [d for d in discover(self.api, devices) if any(p.active for p in d.ports)]
        if not self.devices:
            raise RdmaUnavailable(NO_DEVICE_HINT.format(why="no device has an active port"))
        self.ports = ports_of(self.devices, lag_ports)
        self.port_info = {(p.device, p.port): p for d in self.devices for p in d.ports}

    def _open_devices(self) -> None:
        """Open each device found: its context, PD and CQ (room for every QP's send and receive queue), and the
        64-byte scratch MR the receives point at."""
        self.ctxs, self.pds, self.cqs, self.scratch = [], [], [], []
        self.qps: Dict[tuple, _QP] = {}
        self.by_qpn: Dict[tuple, _QP] = {}
        self.regions: List[Region] = []
        self._backlog: List[Completion] = []
        nq = self.num_qps_per_peer * max(1, len(self.peer_ranks()))
        for slot, d in enumerate(self.devices):
            ctx = _call(self.api, "open device", lambda: self.api.Context(name=d.name), device=d.name)
            self.ctxs.append(ctx)
            self.pds.append(_call(self.api, "alloc PD", lambda: self.api.PD(ctx), device=d.name))
            cqe = nq * (self.sq_depth + self.rq_depth) + 64
            self.cqs.append(_call(self.api, "create CQ", lambda: self.api.CQ(ctx, cqe, None, None, 0), device=d.name))
        self._scratch_buf = ctypes.create_string_buffer(64 * len(self.devices))
        for slot in range(len(self.devices)):
            self.scratch.append(self._mr(slot, None, 64, ctypes.addressof(self._scratch_buf) + 64 * slot,
                                         self._access(False, False)))

    def _slot(self, device: str) -> int:
        return [d.name for d in self.devices].index(device)

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
