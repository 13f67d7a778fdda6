"""Opening a Buffer's runtime (collective over its process group): the constructor's values checked, the ranks
grouped into hosts, the transport between hosts chosen, and the group's shared buffers mapped. Ranks within one
host get a :class:`~triton_ep.runtime.context.Runtime`; ranks on several hosts a
:class:`~triton_ep.runtime.across_hosts.HostsRuntime` over their host's own runtime."""
from __future__ import annotations

import os
import uuid
from typing import Optional

import torch.distributed as dist

from ..transport import ipc, verbs
from ..transport.bootstrap import Exchange
from .across_hosts import HostsRuntime, destroy_groups, no_split_source
from .checks import DEFAULT_TIMEOUT_S, Rejected, bytes_arg, device_arg, raise_rejected, timeout_arg
from .context import Runtime
from .hosts import (ENV_RANKS_PER_HOST, Hosts, agreed, choose_transport, group_hosts, host_identity,
                    rdma_backend_arg)


def ll_area_bytes(num_rdma_bytes: int) -> int:
    """Bytes of a low-latency area for ``num_rdma_bytes``: rounded up to 4 KiB."""
    return (int(num_rdma_bytes) + 4095) // 4096 * 4096


def open_runtime(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode: bool, timeout_s, device,
                 rdma_backend: Optional[str] = None, see_closed: bool = True,
                 args_error: Optional[Exception] = None) -> Runtime:
    """Build one rank's :class:`Runtime` for a Buffer (collective over ``group``): check the constructor's
    values, bootstrap the group's shared buffers (:func:`triton_ep.transport.ipc.open_group`: the normal-mode
    part of ``num_nvl_bytes`` rounded up to 4 KiB, then, with ``low_latency_mode``, the low-latency area of
    ``num_rdma_bytes``), and return the runtime. ``group`` may be an ``ipc.Comm`` (ranks simulated in one
    process, :mod:`triton_ep.testing`). A rank that rejects its values (constructor arguments,
    ``TRITON_EP_TIMEOUT_S``, ``TRITON_EP_SHM_TAG``, ``TRITON_EP_RDMA``) carries the rejection in the host
    exchange: every rank raises it at once (:class:`~triton_ep.runtime.checks.Rejected`); a rank that fails
    otherwise tells its peers (they raise ``EPRemoteError`` at once instead of waiting). The ranks are grouped
    into hosts and the transport between hosts chosen (:mod:`triton_ep.runtime.hosts`; ``rdma_backend``:
    ``"auto"``, ``"verbs"``, ``"emulated"`` or ``None`` for ``TRITON_EP_RDMA``).

    Ranks on several hosts get a :class:`HostsRuntime` instead: each host's ranks share their own buffers
    (nothing is mapped between hosts, which may be different machines). ``see_closed``: the Runtime's (whether a peer
    that destroyed its Buffer ends the waits for it at once); a host's runtime under a :class:`HostsRuntime` is opened
    without it (the close words across hosts name such a peer). ``args_error``: a ``ValueError`` / ``TypeError``
    the caller found in its own constructor values (:class:`~triton_ep.ElasticBuffer`'s arguments), ``None`` where
    it found none: it is this rank's rejection, carried and raised on every rank as a rejected constructor value.

    Raises:
        TypeError: ``group`` is no process group (raised on this rank alone: no exchange is possible).
        ValueError: a bad value on any rank (``args_error``, ``num_nvl_bytes``, ``num_rdma_bytes``, ``timeout_s``,
            ``rdma_backend``, ``device``, the environment's), no process group, ranks that disagree on
            ``rdma_backend`` or ``TRITON_EP_RANKS_PER_HOST``, hosts of different sizes, a host whose ranks run on
            several machines, several hosts and no RDMA transport.
        EPTimeoutError: ranks did not arrive within ``timeout_s`` (named).
        EPRemoteError: a peer gave up or failed first.
    """
    group, exchanges = _group_exchanges(group)
    try:
        timeout_s, backend, device, rejected = _buffer_args(group, exchanges, num_nvl_bytes, num_rdma_bytes,
                                                            timeout_s, device, rdma_backend, args_error)
        if not exchanges:
            size = group.size
            hosts = group_hosts([host_identity()] * size, [os.environ.get(ENV_RANKS_PER_HOST)] * size)
            return Runtime(group, timeout_s, uuid.uuid4().hex, hosts=hosts,
                           rdma_transport=choose_transport(backend, hosts))
        if rejected is None:
            for ex in exchanges:
                ex.timeout_s = timeout_s
        hosts, transport = _find_hosts(exchanges[0], backend, rejected)
    except BaseException as e:      # an interrupt too (KeyboardInterrupt): the peers must not wait it out
        why = (f"rejected its Buffer arguments ({type(e).__name__}: {e})" if isinstance(e, Exception)
               else f"was interrupted while building its Buffer ({type(e).__name__})")
        for ex in exchanges:
            ex.fail(why)
        raise
    if hosts.num_hosts > 1:
        return _open_hosts(group, hosts, transport, num_nvl_bytes, timeout_s, device)
    # the low-latency area follows the normal-mode part of the same shared buffer (every rank maps it),
    # which normal-mode rounds never touch
    nvl_part = max(4096, (int(num_nvl_bytes) + 4095) // 4096 * 4096)
    ll_bytes = ll_area_bytes(num_rdma_bytes) if low_latency_mode else 0
    comm = ipc.open_group(group, nvl_part + ll_bytes, device, timeout_s, exchange=exchanges[1])
    comm.min_bytes -= ll_bytes
    return Runtime(comm, timeout_s, uuid.uuid4().hex, group, nvl_part, ll_bytes, hosts, transport, see_closed)


def _group_exchanges(group):
    """``open_runtime``'s ``group`` checked (``None``: the default process group) and its two set-up exchanges
    (host identities, buffer handles): ``(group, [Exchange, Exchange])``; ``(group, [])`` for an ``ipc.Comm``
    (ranks simulated in one process). The exchanges are made before the values are checked: a rank that rejects
    its arguments tells its peers at once. Raises ``ValueError`` (no group and no ``torch.distributed``, or this rank
    outside ``group``: ``new_group``'s ``NON_GROUP_MEMBER``) and ``TypeError`` (no process group) on this rank alone."""
    if isinstance(group, ipc.Comm):
        return group, []
    if group is None and not dist.is_initialized():
        raise ValueError("Buffer(group=None) needs torch.distributed initialised (init_process_group) "
                         "or an explicit group")
    group = group if group is not None else dist.group.WORLD
    if _non_member(group):
        raise ValueError(f"Buffer's group: this process (global rank {dist.get_rank() if dist.is_initialized() else '?'}) is not a member of it "
                         f"(torch.distributed.new_group gives GroupMember.NON_GROUP_MEMBER outside its ranks): build "
                         f"the Buffer only on the group's ranks")
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise TypeError(f"Buffer's group must be a torch.distributed ProcessGroup (or None: the default group), "
                        f"got {type(group).__name__}")
    return group, [Exchange(group, DEFAULT_TIMEOUT_S, "bootstrap: exchange host identities"),
                   Exchange(group, DEFAULT_TIMEOUT_S, "bootstrap: exchange buffer handles")]


def _non_member(group) -> bool:
    """``group`` is what ``torch.distributed.new_group`` returns on a rank outside the new group."""
    member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())
    return group is member or (type(group) is type(member) and group == member)


def _buffer_args(group, exchanges: list, num_nvl_bytes, num_rdma_bytes, timeout_s, device, rdma_backend,
                 args_error: Optional[Exception] = None):
    """The constructor's values checked (``open_runtime``'s; ``args_error``, the caller's own rejection, first):
    ``(timeout_s, backend, device, rejected)``. Over a process group (``exchanges``) a rejected value is not raised
    but returned as ``rejected``: it is carried in the host exchange, and every rank raises it at once instead of
    its peers waiting."""
    rejected = backend = None
    try:
        if args_error is not None:
            raise args_error
        timeout_s = timeout_arg(timeout_s)
        bytes_arg("num_nvl_bytes", num_nvl_bytes)
        bytes_arg("num_rdma_bytes", num_rdma_bytes)
        ipc.shm_tag()       # (it names the shared-memory files: checked before any is made)
        backend = rdma_backend_arg(rdma_backend)
        device = device_arg(device) if exchanges else device
    except (ValueError, TypeError) as e:
        if not exchanges:
            raise
        rejected = Rejected.of(e, group.rank())
    return timeout_s, backend, device, rejected


def _find_hosts(exchange: Exchange, backend: Optional[str], rejected: Optional[Rejected] = None):
    """Exchange host identities (and each rank's ``TRITON_EP_RANKS_PER_HOST``, ``rdma_backend`` and the
    rejection of its own constructor values, ``None`` where it has none), group the ranks into hosts and choose
    the transport between them: ``(Hosts, transport)``. Every rank raises the same error where the exchanged
    values are at fault (a rank's rejection first)."""
    info = exchange.gather((host_identity(), os.environ.get(ENV_RANKS_PER_HOST), backend, rejected,
                            _qos_rejection(exchange.rank)))
    raise_rejected([i[3] for i in info])
    agreed("rdma_backend / TRITON_EP_RDMA", [i[2] for i in info])
    hosts = group_hosts([i[0] for i in info], [i[1] for i in info])
    if hosts.num_hosts > 1:     # (the transport between hosts reads them)
        raise_rejected([i[4] for i in info])
    transport = choose_transport(backend, hosts)
    for h in range(hosts.num_hosts):       # a host's ranks share memory: they must run on one machine
        machines = sorted({info[r][0] for r in hosts.ranks(h)})
        if len(machines) > 1:
            raise ValueError(f"{ENV_RANKS_PER_HOST} puts ranks {list(hosts.ranks(h))} into host {h}, but they run on "
                             f"{len(machines)} machines ({', '.join(machines)}); a host's ranks must share a machine")
    return hosts, transport


def _qos_rejection(rank: int) -> Optional[Rejected]:
    """This rank's rejection of ``TRITON_EP_RDMA_TC`` / ``TRITON_EP_RDMA_SL`` (``verbs.QoS.resolve``), or ``None``:
    exchanged at set-up so that a bad value on one rank raises on every rank, where ranks span hosts."""
    try:
        verbs.QoS.resolve()
    except ValueError as e:
        return Rejected.of(e, rank)
    return None


def _open_hosts(group, hosts: Hosts, transport: str, num_nvl_bytes: int, timeout_s: float, device) -> HostsRuntime:
    """The :class:`HostsRuntime` of a Buffer whose ranks span several hosts (collective over ``group``): a
    process group per host and one per local index (every rank makes every subgroup, in the same order), and
    this host's own runtime (its ranks' shared buffers, of ``num_nvl_bytes``)."""
    def world(ranks):           # hosts number the ranks of ``group``; new_group takes global ranks
        return [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in ranks]

    me = group.rank()
    with no_split_source():
        local_groups = [dist.new_group(world(hosts.ranks(h))) for h in range(hosts.num_hosts)]
        peer_groups = [dist.new_group(world([hosts.ranks(h)[i] for h in range(hosts.num_hosts)]))
                       for i in range(hosts.ranks_per_host)]
    host = hosts.host_of[me]
    mine = (local_groups[host], peer_groups[hosts.local_index(me)])
    try:
        local = open_runtime(local_groups[host], num_nvl_bytes, 0, False, timeout_s, device, see_closed=False)
    except BaseException:
        destroy_groups(mine)
        raise
    try:
        local.agree_on_layout()
    except BaseException:
        try:
            local.close()
        finally:
            destroy_groups(mine)
        raise
    return HostsRuntime(local, group, me, group.size(), hosts, transport, local_groups[host],
                        peer_groups[hosts.local_index(me)])
