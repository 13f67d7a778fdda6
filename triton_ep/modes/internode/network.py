"""A Buffer's RDMA leg between hosts: the transport (pyverbs or the emulated fabric), the RDMA scheduler on
it, and the scheduler's registered region (rings in host memory, pinned and device-mapped on GPU). Internode
normal mode opens one between RDMA peers (a rank per host), internode low-latency mode one between all
ranks.

Where the proxy runs is ``TRITON_EP_PROXY`` (:mod:`triton_ep.proxy_process`): ``thread`` (default), the
scheduler's threads in the rank's process; ``process``, a process of its own per rank, which owns the transport,
the rings shared with the rank in /dev/shm (Linux). The leg's ranks agree on it in a set-up exchange of its own.
"""
from __future__ import annotations

import dataclasses

import torch

from ... import proxy_process
from ... import scheduler as sched_mod
from ...runtime import hosts as hosts_mod
from ...runtime.fabric import factory, gather_objects


def delays_to_exchange(backend: str, rank: int):
    """What rank ``rank`` puts in its Buffer's set-up exchange about the emulated fabric's delays
    (``TRITON_EP_EMULATED_REORDER_S``, ``TRITON_EP_EMULATED_SKEW_S``): ``(reorder_s, skew_s)``, the text of its
    error for a bad value (raised on every rank after the exchange, by :func:`agreed_delays`), or ``None`` for
    the verbs backend (which reads neither)."""
    if backend != "emulated":
        return None
    try:
        return factory.fabric_delays()
    except ValueError as ex:
        return f"rank {rank}: {ex}"


def agreed_delays(values):
    """Every rank's :func:`delays_to_exchange`, checked after the exchange: the delays the fabric takes.

    Raises:
        ValueError: on every rank alike, where a rank's value was bad (naming that rank and the variable) or
            the ranks' values differ.
    """
    hosts_mod.first_error(values)
    hosts_mod.agreed(f"{factory.ENV_REORDER_S} and {factory.ENV_SKEW_S} (the emulated fabric's delays)", values)
    return values[0] if values else None


def agreed_proxy(group, rank: int, timeout_s: float) -> str:
    """Where the ranks of ``group`` run their RDMA proxies (:func:`triton_ep.proxy_process.proxy_kind`), agreed in
    a set-up exchange (collective over ``group``): ``"thread"`` or ``"process"``.

    Raises:
        ValueError: on every rank alike, where a rank's ``TRITON_EP_PROXY`` is bad (naming that rank) or the
            ranks' values differ (naming each rank's).
        EPTimeoutError / EPRemoteError: a rank did not take part within ``timeout_s``.
    """
    try:
        mine = (proxy_process.proxy_kind(),)      # (a tuple: a str in the exchange is a rank's error text)
    except ValueError as ex:
        mine = f"rank {rank}: {ex}"
    values = gather_objects(group, mine, timeout_s, "rdma: where the proxy runs")
    hosts_mod.first_error(values)
    hosts_mod.agreed(f"{proxy_process.ENV_PROXY} (where the RDMA proxy runs)", [v[0] for v in values])
    return values[0][0]


@dataclasses.dataclass
class Network:
    """An open RDMA leg.

    Attributes:
        transport: the connected transport (QPs to every peer in RTS); with the proxy in a process of its own,
            the :class:`~triton_ep.proxy_process.ProcessScheduler` (the transport is the proxy's).  sched: the
            started :class:`~triton_ep.scheduler.Scheduler` (or ``ProcessScheduler``: the same host API).  mem: its
            region, uint8 (control block, send ring, receive ring).  ring_ctl: int64 view of the control block.  send, recv: int32 views of the rings.
    """
    transport: object
    sched: sched_mod.Scheduler
    mem: torch.Tensor
    ring_ctl: torch.Tensor
    send: torch.Tensor
    recv: torch.Tensor

    def close(self) -> None:
        """Stop the proxy, then release the QPs, MRs, CQs and PD. Idempotent."""
        try:
            self.sched.close()
        finally:
            self.transport.close()


def open_network(backend: str, group, rank: int, world: int, *, token: str, names, name: str,
                 num_qps_per_peer: int, slots: int, slot_bytes: int, timeout_s: float,
                 device: torch.device, peers=None, delays=None, **sched_kwargs) -> Network:
    """Open rank ``rank``'s RDMA leg to the ``world`` ranks of ``group`` (collective over it).

    Args:
        backend: ``"verbs"`` or ``"emulated"`` (then ``names``: every member's NIC name on the fabric
            ``token``, ``name``: this rank's).
        num_qps_per_peer: RC QPs per peer.  slots, slot_bytes: the scheduler's rings.
        device: the kernels' device: on CUDA the region is pinned host memory (device-mapped).
        peers: the ranks of ``group`` to make QPs to (default: every other one).
        delays: the emulated fabric's ``(reorder_s, skew_s)`` as the ranks agreed on them (:func:`agreed_delays`);
            ``None``: read from the environment.
        sched_kwargs: more :class:`~triton_ep.scheduler.Scheduler` arguments.
    Raises:
        what the transport and the bootstrap raise (``EPTimeoutError`` for a peer that never joins), and
        :func:`agreed_proxy`'s ``ValueError``; nothing stays open on the way out.
    """
    kind = agreed_proxy(group, rank, timeout_s)
    kw = dict(num_qps_per_peer=num_qps_per_peer, timeout_s=timeout_s, peers=peers)
    fabric = None
    if backend == "emulated":
        fabric = factory.emulated_fabric(list(names), token, delays=delays)
        kw.update(fabric=fabric, device_name=name)
    elif device.type == "cuda":
        kw["gpu"] = device.index
    lay = sched_mod.RingLayout(world, slots, slot_bytes)
    c, r = lay.ctrl_bytes, lay.ring_bytes
    if kind == "process":
        ps = proxy_process.bootstrap_process(backend, rank, world, kw, dict(slots=slots, slot_bytes=slot_bytes,
                                                                            timeout_s=timeout_s, **sched_kwargs),
                                             group=group, device=device)
        mem = torch.from_numpy(ps.mem)
        return Network(ps, ps, mem, mem[:c].view(torch.int64), mem[c:c + r].view(torch.int32),
                       mem[c + r:c + 2 * r].view(torch.int32))
    transport = factory.open_transport(backend, rank, world, **kw)
    try:
        mem = torch.zeros(lay.nbytes, dtype=torch.uint8, device="cpu", pin_memory=device.type == "cuda")
        sched = sched_mod.bootstrap(transport, dict(slots=slots, slot_bytes=slot_bytes, memory=mem,
                                                    timeout_s=timeout_s, **sched_kwargs), group=group)
    except BaseException:
        transport.close()
        raise
    if fabric is not None:      # every peer has mapped this rank's rings: a killed process leaves none
        fabric.unlink_rings()
    return Network(transport, sched, mem, mem[:c].view(torch.int64), mem[c:c + r].view(torch.int32),
                   mem[c + r:c + 2 * r].view(torch.int32))

