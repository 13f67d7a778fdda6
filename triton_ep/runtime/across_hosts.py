"""The runtime of a Buffer whose ranks span several hosts (:class:`HostsRuntime`: the group's view over this
host's own :class:`~triton_ep.runtime.context.Runtime`), and the process groups it makes for itself."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..config import EventOverlap
from ..transport import ipc
from .checks import check_num_experts
from .context import Runtime, live_comm
from .hosts import Hosts

Tensor = torch.Tensor


@contextlib.contextmanager
def no_split_source():
    """While the block makes subgroups: a default group bound to a device (``init_process_group(device_id=...)``,
    as DeepEP's test programs call it) whose backend cannot split (gloo) is unbound. torch then makes a subgroup
    by splitting the bound backend, and on the ranks outside the subgroup calls its ``perform_nocolor_split``,
    which gloo lacks (torch 2.11: ``AttributeError``); unbound, every subgroup is made the plain way."""
    pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    bound = getattr(pg, "bound_device_id", None)
    if bound is None:
        yield
        return
    try:
        splits = hasattr(pg._get_backend(bound), "perform_nocolor_split")
    except RuntimeError:                # no backend for that device: nothing to split from either
        splits = True
    if splits:
        yield
        return
    pg.bound_device_id = None
    try:
        yield
    finally:
        pg.bound_device_id = bound


def destroy_groups(groups) -> None:
    """Release the process groups a Buffer made for itself (each holds sockets and threads)."""
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except Exception:       # noqa: BLE001 - already gone (the default group was destroyed first)
            pass


class HostsRuntime:
    """The runtime of a Buffer whose ranks span several hosts: the group's view (global rank and size, hosts,
    the transport between them) over this host's own :class:`Runtime` (``local``: the shared buffers,
    signals and streams of this host's ranks). Nothing is mapped between hosts. The group-wide argument
    checks and the routing layout use it as they use a :class:`Runtime`; the data moves through
    :mod:`triton_ep.modes.internode`.

    Attributes:
        local: this host's runtime. local_group: the process group of this host's ranks. peer_group: the
        process group of the ranks with this rank's local index on every host (its RDMA peers). group, rank,
        group_size, hosts, num_hosts, rdma_transport, timeout_s, device, uid: as :class:`Runtime`'s.
    """

    ll_offset = ll_bytes = 0

    def __init__(self, local: Runtime, group, rank: int, size: int, hosts: Hosts, rdma_transport: str,
                 local_group, peer_group) -> None:
        self.local, self.group, self.rank, self.group_size = local, group, rank, size
        self.hosts, self.num_hosts, self.rdma_transport = hosts, hosts.num_hosts, rdma_transport
        self.local_group, self.peer_group = local_group, peer_group
        self._groups = (local_group, peer_group)
        self.timeout_s, self.device, self.uid = local.timeout_s, local.device, local.uid

    @property
    def comm(self):
        """This host's shared buffers (``None`` once closed)."""
        return self.local.comm

    @property
    def comm_stream(self):
        return self.local.comm_stream

    @property
    def pid(self) -> int:
        """The process that built the Buffer (:attr:`Runtime.pid`)."""
        return self.local.pid

    def live(self) -> ipc.Comm:
        """:meth:`Runtime.live`, naming this rank by its global number."""
        return live_comm(self.local.comm, self.rank, self.local.pid)

    def check(self) -> None:
        self.local.check()

    def close(self) -> None:
        """Release this host's shared buffers, then the host's and the RDMA peers' process groups. Idempotent."""
        try:
            self.local.close()
        finally:
            # gloo frees a group's sockets and threads once nothing refers to it: drop every reference
            groups, self._groups = self._groups, ()
            self.local_group = self.peer_group = self.local.group = None
            destroy_groups(groups)

    def agree_on_layout(self) -> None:
        """Done by this host's runtime at construction."""

    def check_tensor(self, *args, **kwargs) -> Tensor:
        return self.local.check_tensor(*args, **kwargs)

    def check_handle(self, handle, kind: type, made_by: str):
        """:meth:`Runtime.check_handle` (this host's Runtime has the Buffer's uid)."""
        return self.local.check_handle(handle, kind, made_by)

    def check_num_experts(self, num_experts) -> None:
        """:func:`triton_ep.runtime.checks.check_num_experts` for the whole group (every host's ranks)."""
        check_num_experts(num_experts, self.group_size)

    def comm_ctx(self):
        return self.local.comm_ctx()

    def begin(self, previous_event, async_finish: bool) -> None:
        self.local.begin(previous_event, async_finish)

    def end(self, async_finish: bool, tensors) -> EventOverlap:
        return self.local.end(async_finish, tensors)

    def wait_comm_stream(self) -> None:
        self.local.wait_comm_stream()
