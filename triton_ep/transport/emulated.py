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

Its parts, each name importable from here too: :mod:`~triton_ep.transport.emulated_api` (enums, errors, attribute
and work-request classes), :mod:`~triton_ep.transport.emulated_spec` (ports, devices, addressing),
:mod:`~triton_ep.transport.emulated_ring` (the rings and their records), :mod:`~triton_ep.transport.emulated_engine`
(the progress thread, the rate model), :mod:`~triton_ep.transport.emulated_device` (context, PD, MR, CQ, mlx5
calls) and :mod:`~triton_ep.transport.emulated_qp` (the RC QP); this module holds the :class:`Fabric`.
"""
from __future__ import annotations

import errno as _errno
import os
import tempfile
import uuid
from types import SimpleNamespace
from typing import List, Optional, Tuple

# (E, WC and PEER_LOOK_S are this module's names too, as before it was split)
from triton_ep.transport.emulated_api import (AHAttr, E, GID, GlobalRoute, PyverbsError, PyverbsRDMAError,
                                              PyverbsUserError, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR, SGE, WC,
                                              enums)
from triton_ep.transport.emulated_device import CQ, MR, PD, Mlx5QP, _Context
from triton_ep.transport.emulated_engine import PEER_LOOK_S, RateModel, _Engine, nic_cpu_s
from triton_ep.transport.emulated_qp import QP
from triton_ep.transport.emulated_ring import _created_rings
from triton_ep.transport.emulated_spec import (DeviceSpec, FabricSpec, PortSpec, gid_table, is_link_local, mtu_code,
                                               port_gids, port_lid, segment_of)
from triton_ep.transport.shm import shm_name


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


__all__ = ["Fabric", "FabricSpec", "nic_cpu_s", "DeviceSpec", "PortSpec", "RateModel", "enums", "port_gids", "port_lid",
           "gid_table", "mtu_code", "segment_of", "is_link_local",
           "PyverbsError", "PyverbsRDMAError", "PyverbsUserError"]
