"""A Buffer's RDMA leg between hosts: the transport (pyverbs or the emulated fabric), the RDMA scheduler on
it, and the scheduler's registered region (rings in host memory, pinned and device-mapped on GPU). Internode
normal mode opens one between RDMA peers (a rank per host), internode low-latency mode one between all
ranks.

Where the proxy runs is ``TRITON_EP_PROXY`` (:mod:`triton_ep.proxy_process`): ``process`` (the default on
Linux), a process of its own per rank, which owns the transport, the rings shared with the rank in /dev/shm;
``thread`` (the default elsewhere), the scheduler's threads in the rank's process. Every rank of the Buffer's group
agrees on it in the mode's set-up exchange (:func:`proxy_to_exchange`, :func:`agreed_proxy_kind`), which passes
it to :func:`open_network`.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Mapping, Optional, Tuple, Union

import torch

from ... import proxy_process
from ... import scheduler as sched_mod
from ...protocol.limits import check_ring_memory
from ...runtime import hosts as hosts_mod
from ...runtime.fabric import factory, gather_objects


#: the network leg's defaults: RC QPs per RDMA peer, ring slots per peer, bytes per slot (chunk)
DEFAULT_QPS_PER_PEER, DEFAULT_SLOTS, DEFAULT_SLOT_BYTES = 4, 8, 1 << 16
#: environment variables that override them (every rank must set the same values)
ENV_QPS, ENV_SLOTS, ENV_CHUNK = "TRITON_EP_RDMA_QPS_PER_PEER", "TRITON_EP_RDMA_SLOTS", "TRITON_EP_RDMA_CHUNK_BYTES"
#: the environment variable that sends every num_worst_tokens call across hosts down the capture path
#: (:mod:`.capture`; every rank must set the same)
ENV_CAPTURE_PATH = "TRITON_EP_INTERNODE_CAPTURE_PATH"


def network_shape(env: Mapping[str, str] = os.environ) -> Tuple[int, int, int]:
    """The network leg's shape: ``(QPs per RDMA peer, ring slots per peer, bytes per slot)``, from
    ``TRITON_EP_RDMA_QPS_PER_PEER`` (default 4), ``TRITON_EP_RDMA_SLOTS`` (8) and ``TRITON_EP_RDMA_CHUNK_BYTES``
    (65536, a multiple of 64). The rings take ``2 * (num_hosts - 1) * slots * chunk`` bytes of pinned host
    memory per rank (DeepEP's ``num_rdma_bytes`` is a hint this mode does not need).

    Raises:
        ValueError: a value that is not an integer in range, naming the variable.
    """
    def get(name: str, default: int, lo: int, hi: int, multiple: int = 1) -> int:
        raw = env.get(name, "").strip()
        if not raw:
            return default
        try:
            v = int(raw)
        except ValueError:
            v = lo - 1
        if not lo <= v <= hi or v % multiple:
            extra = f", a multiple of {multiple}" if multiple > 1 else ""
            raise ValueError(f"{name}={raw!r} must be an integer in [{lo}, {hi}]{extra}")
        return v

    return (get(ENV_QPS, DEFAULT_QPS_PER_PEER, 1, 64), get(ENV_SLOTS, DEFAULT_SLOTS, 1, 1024),
            get(ENV_CHUNK, DEFAULT_SLOT_BYTES, 64, 1 << 30, 64))


def traffic_stats(transport: Optional[str] = None, num_hosts: int = 1, sched_stats: Optional[dict] = None,
                  network_s: float = 0.0, exchanges: int = 0, host_exchanges: int = 0,
                  capture_staging_bytes: int = 0) -> dict:
    """``Buffer.get_rdma_stats``'s dict from the scheduler's :meth:`~triton_ep.scheduler.Scheduler.stats`
    (channels summed from its QPs) and the capture path's largest staging areas (bytes); the defaults give a Buffer on one
    host: no traffic."""
    s = sched_stats or {"qps": {}, "ports": {}, "wrs": 0, "proxy_busy_s": 0.0, "proxy_post_s": 0.0,
                        "proxy_transport_s": 0.0, "proxy_cpu_s": 0.0, "proxy_transport_cpu_s": 0.0,
                        "proxy_busy_sweeps": 0}
    channels: dict = {}
    for q in s["qps"].values():
        c = channels.setdefault(q["channel"], {"bytes": 0, "chunks": 0})
        c["bytes"] += q["bytes"]
        c["chunks"] += q["chunks"]
    return {"transport": transport, "num_hosts": num_hosts, "qps": s["qps"], "ports": s["ports"],
            "channels": channels, "wrs": s["wrs"], "chunks": sum(q["chunks"] for q in s["qps"].values()),
            "proxy_busy_s": s["proxy_busy_s"], "proxy_post_s": s["proxy_post_s"],
            "proxy_transport_s": s["proxy_transport_s"], "proxy_cpu_s": s["proxy_cpu_s"],
            "proxy_transport_cpu_s": s["proxy_transport_cpu_s"],
            "proxy_busy_sweeps": s["proxy_busy_sweeps"], "network_s": network_s, "exchanges": exchanges,
            "host_exchanges": host_exchanges, "capture_staging_bytes": capture_staging_bytes}



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


def proxy_to_exchange(rank: int):
    """What rank ``rank`` (of the Buffer's group) puts in its Buffer's set-up exchange about ``TRITON_EP_PROXY``:
    ``(kind,)``, or the text of its error for a bad value (raised on every rank after the exchange by
    :func:`agreed_proxy_kind`)."""
    try:
        return (proxy_process.proxy_kind(),)      # (a tuple: a str in the exchange is a rank's error text)
    except ValueError as ex:
        return f"rank {rank}: {ex}"


def agreed_proxy_kind(values) -> str:
    """Every rank of the Buffer's group's :func:`proxy_to_exchange`, checked after the exchange: where the RDMA
    proxies run.

    Raises:
        ValueError: on every rank alike, where a rank's value was bad (naming that rank) or the ranks' values
            differ (naming each rank's, by its rank in the Buffer's group).
    """
    hosts_mod.first_error(values)
    hosts_mod.agreed(f"{proxy_process.ENV_PROXY} (where the RDMA proxy runs)", [v[0] for v in values])
    return values[0][0]


def capture_setting(rank: int) -> Union[None, bool, str]:
    """What rank ``rank`` puts in the set-up exchange about ``TRITON_EP_INTERNODE_CAPTURE_PATH``: ``None`` (unset),
    ``True`` / ``False`` (``1`` / ``0``), or the text of its error for another value (raised on every rank after
    the exchange)."""
    raw = os.environ.get(ENV_CAPTURE_PATH, "").strip()
    return (None if not raw else raw == "1") if raw in ("", "0", "1") else \
        f"rank {rank}: {ENV_CAPTURE_PATH}={raw!r} must be 0 or 1 (or unset)"


@dataclasses.dataclass
class SetUp:
    """Internode normal mode's set-up exchange (:func:`agree_set_up`): what each rank offers (a value, or the text of
    its error for a bad one), and afterwards what every rank agreed on."""
    token: str                      # the fabric token: rank 0's names the rings
    shape: Union[tuple, str]        # (QPs per RDMA peer, ring slots per peer, bytes per slot)
    capture: Union[None, bool, str]     # TRITON_EP_INTERNODE_CAPTURE_PATH (capture_setting)
    low_latency: tuple              # the Buffer's (low_latency_mode, num_rdma_bytes)
    delays: object                  # the emulated fabric's (reorder_s, skew_s); None: verbs (delays_to_exchange)
    proxy: object                   # where the RDMA proxies run (offered: proxy_to_exchange; agreed: the kind)


def agree_set_up(rt, num_hosts: int, shape: tuple, low_latency: tuple) -> SetUp:
    """The set-up exchange of internode normal mode over ``rt`` (the Buffer's runtime: its group, rank, timeout and
    RDMA transport): every rank's fabric token, network-leg shape (``shape``: the arguments ``(num_qps_per_peer,
    slots, slot_bytes)``, each ``None`` for :func:`network_shape`'s), capture-path setting,
    ``(low_latency_mode, num_rdma_bytes)``, emulated delays and proxy kind, checked equal. Bad environment values
    are raised after the exchange, on every rank alike: the peers do not wait out their timeout for this rank.

    Raises:
        ValueError: on every rank alike, a bad value (naming its rank) or values that differ between ranks.
        EPTimeoutError / EPRemoteError: a rank did not take part within ``rt.timeout_s``.
    """
    me = rt.rank
    try:
        shape = tuple(e if v is None else int(v) for v, e in zip(shape, network_shape()))
        check_ring_memory(shape[1], shape[2], num_hosts - 1, ENV_SLOTS, ENV_CHUNK)
    except ValueError as ex:
        shape = f"rank {me}: {ex}"
    mine = SetUp(uuid.uuid4().hex[:12], shape, capture_setting(me), tuple(low_latency),
                 delays_to_exchange(rt.rdma_transport, me), proxy_to_exchange(me))
    every = gather_objects(rt.group, mine, rt.timeout_s, "internode: fabric token")
    hosts_mod.first_error([v for e in every for v in (e.shape, e.capture)])
    delays = agreed_delays([e.delays for e in every])
    proxy = agreed_proxy_kind([e.proxy for e in every])
    hosts_mod.agreed("low_latency_mode and num_rdma_bytes", [e.low_latency for e in every])
    hosts_mod.agreed(f"the network leg's shape ({ENV_QPS}, {ENV_SLOTS}, {ENV_CHUNK})", [e.shape for e in every])
    hosts_mod.agreed(ENV_CAPTURE_PATH, [e.capture for e in every])
    return SetUp(every[0].token, shape, mine.capture, mine.low_latency, delays, proxy)


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
    mem: Optional[torch.Tensor]          # (None once closed: drop_views)
    ring_ctl: Optional[torch.Tensor]
    send: Optional[torch.Tensor]
    recv: Optional[torch.Tensor]

    def close(self) -> None:
        """Stop the proxy, then release the QPs, MRs, CQs and PD, and drop the views of the region (with the proxy
        in a process of its own its mapping is closed then, :meth:`ProcessScheduler.close
        <triton_ep.proxy_process.ProcessScheduler.close>`). Idempotent."""
        self.drop_views()
        try:
            self.sched.close()
        finally:
            self.transport.close()

    def drop_views(self) -> None:
        """Forget the views of the region: nothing that still reaches this object keeps it mapped."""
        self.mem = self.ring_ctl = self.send = self.recv = None


def open_network(backend: str, group, rank: int, world: int, *, token: str, names, name: str,
                 num_qps_per_peer: int, slots: int, slot_bytes: int, timeout_s: float,
                 device: torch.device, proxy: str, peers=None, delays=None, **sched_kwargs) -> Network:
    """Open rank ``rank``'s RDMA leg to the ``world`` ranks of ``group`` (collective over it).

    Args:
        backend: ``"verbs"`` or ``"emulated"`` (then ``names``: every member's NIC name on the fabric
            ``token``, ``name``: this rank's).
        num_qps_per_peer: RC QPs per peer.  slots, slot_bytes: the scheduler's rings.
        device: the kernels' device: on CUDA the region is pinned host memory (device-mapped).
        proxy: where the RDMA proxy runs, ``"thread"`` or ``"process"``, as every rank of the Buffer's group agreed
            in its set-up exchange (:func:`agreed_proxy_kind`).
        peers: the ranks of ``group`` to make QPs to (default: every other one).
        delays: the emulated fabric's ``(reorder_s, skew_s)`` as the ranks agreed on them (:func:`agreed_delays`);
            ``None``: read from the environment.
        sched_kwargs: more :class:`~triton_ep.scheduler.Scheduler` arguments.
    Raises:
        what the transport and the bootstrap raise (``EPTimeoutError`` for a peer that never joins); nothing stays
        open on the way out.
    """
    kw = dict(num_qps_per_peer=num_qps_per_peer, timeout_s=timeout_s, peers=peers)
    fabric = None
    if backend == "emulated":
        fabric = factory.emulated_fabric(list(names), token, delays=delays)
        kw.update(fabric=fabric, device_name=name)
    elif device.type == "cuda":
        kw["gpu"] = device.index
    lay = sched_mod.RingLayout(world, slots, slot_bytes)
    c, r = lay.ctrl_bytes, lay.ring_bytes
    if proxy == "process":
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

