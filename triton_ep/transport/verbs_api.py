"""The pyverbs namespace the verbs backend (:mod:`triton_ep.transport.verbs`) calls through: :func:`load_pyverbs`
builds it from rdma-core's package, :meth:`triton_ep.transport.emulated.Fabric.pyverbs` from the emulator.

Enum layouts: rdma-core <= 58 exposes flat ``IBV_*`` names in ``pyverbs.enums``; with Cython >= 3.1
(rdma-core >= 59) the names live only inside enum classes of ``pyverbs.libibverbs_enums``
(``ibv_wr_opcode.IBV_WR_RDMA_WRITE``).  :class:`EnumShim` reads either.
"""
from __future__ import annotations

import enum as _enum
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

from triton_ep.transport.rdma import RdmaError, RdmaUnavailable

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


def _call(api: SimpleNamespace, what: str, fn, **where: Any):
    """Run a verbs call; turn a pyverbs error into :class:`RdmaError` naming ``where``."""
    try:
        return fn()
    except api.PyverbsError as ex:
        raise RdmaError(f"{what} failed: {ex}", errno=getattr(ex, "error_code", None), **where) from ex
