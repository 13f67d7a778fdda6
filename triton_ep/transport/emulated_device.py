"""The device-level objects of the emulated fabric (:mod:`triton_ep.transport.emulated`): the device context and
its port and GID queries, protection domains, memory regions, completion queues, and the two mlx5 direct-verbs
calls."""
from __future__ import annotations

import collections
import ctypes
import errno as _errno
import threading
from types import SimpleNamespace
from typing import List, Optional, Tuple

from triton_ep.transport.emulated_api import E, GID, WC, PyverbsRDMAError
from triton_ep.transport.emulated_spec import PortSpec, gid_table, mtu_code, port_lid


class _Context:
    """``ibv_context`` of an emulated device."""

    def __init__(self, fabric: "Fabric", name: str) -> None:
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
