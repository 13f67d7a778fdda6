"""Normal mode across hosts (DeepEP's internode normal mode): two-level dispatch and combine.

**Two levels, as DeepEP.** Rank ``s`` (host ``h``, local index ``l``) sends each token once to every other
host that holds one of its experts, to the rank with the same local index there (its *RDMA peer*), through
the RDMA scheduler (:mod:`triton_ep.scheduler`); that rank forwards it, with the intranode dispatch over
IPC, to the ranks of its host that need it. Combine runs backwards: rows are summed inside the destination
host first (the intranode combine: fp32 in ascending local rank order, rounded once to bf16), cross the
network once as bf16 partial sums, and are summed on the source rank in ascending host order in fp32 (plus
the biases) and rounded once more to bf16. :func:`triton_ep.reference.combine` with ``ranks_per_host``
models that order exactly.

**The network leg runs in kernels** (:mod:`triton_ep.kernels.net`): a pack kernel writes each host's
record stream into the RDMA scheduler's send rings and releases ``READY``; the proxy threads post each
chunk's WRITEs and then its signal on one QP of the plan; an unpack kernel acquires ``TAIL``, copies the
chunks out and releases ``HEAD`` (credits).  A launch moves at most ``slots`` chunks per peer; larger
transfers run in rounds.  On the host path the host exchanges a small header with its RDMA peers per call
(counts, record layout, status) and waits for the ring kernels; the capture path
(:mod:`triton_ep.modes.internode.capture`: ``num_worst_tokens`` dispatches on a GPU, and the cached
dispatches and combines of GPU handles) keeps all of that on the device, so it captures in a CUDA graph.
The forwarding leg is an intranode call on both.

Records on the network leg: :class:`triton_ep.protocol.records.NetRecord` (``[meta (4 int32: global source
rank, source token, 0, 0) | x row | scales | top-k ids (int64) | top-k weights (fp32) | is_token_in_rank of
the destination host's ranks (1 byte each)]``, 16-byte aligned).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import uuid
from types import SimpleNamespace
from typing import List, Mapping, Optional, Tuple

import numpy as np
import torch

from ... import scheduler as sched_mod
from ...config import EventOverlap
from ...errors import EPCapacityError, EPError, EPRemoteError, EPTimeoutError
from ...runtime import Runtime
from ...runtime.checks import check_event
from ...runtime import hosts as hosts_mod
from ...runtime.fabric import gather_objects, stall_watchdog
from ... import kernels
from ...kernels import net
from ...kernels._util import cdiv, interpreted
from ...protocol import call_card
from ...protocol.records import (HOST_CAPACITY, HOST_CARD_WORDS, HOST_FAILED, HOST_HEADER_WORDS, HOST_KEY_WORDS,
                                HOST_MISMATCH, HOST_OK, NET_META_BYTES, NetRecord)
from ...protocol.signal_header import STAGE_CAPACITY
from ..intranode import DispatchHandle, Intranode, check_cached_dispatch
from .capture import ENV_CAPTURE_PATH, CapturePath, CapturePlan
from .handle import InternodeHandle, byte_columns, record_field, record_meta
from .network import agreed_delays, delays_to_exchange, open_network

Tensor = torch.Tensor
_SKIP = object()            # the handle of a local call a rank takes only to fail it (Internode._skip_local)
#: the network leg's defaults: RC QPs per RDMA peer, ring slots per peer, bytes per slot (chunk)
DEFAULT_QPS_PER_PEER, DEFAULT_SLOTS, DEFAULT_SLOT_BYTES = 4, 8, 1 << 16
#: environment variables that override them (every rank must set the same values)
ENV_QPS, ENV_SLOTS, ENV_CHUNK = "TRITON_EP_RDMA_QPS_PER_PEER", "TRITON_EP_RDMA_SLOTS", "TRITON_EP_RDMA_CHUNK_BYTES"
#: the host path's header and its status codes (protocol/records.py)
_KEY_WORDS, _CARD_WORDS, HEADER_WORDS = HOST_KEY_WORDS, HOST_CARD_WORDS, HOST_HEADER_WORDS
_OK, _FAILED, _CAPACITY, _MISMATCH = HOST_OK, HOST_FAILED, HOST_CAPACITY, HOST_MISMATCH
#: the forwarding leg's dispatches (of records) as disagreements name them (:data:`hosts.FORWARDED_DISPATCH`)
_FORWARDED_CODES = {call_card.DISPATCH: hosts_mod.FORWARDED_DISPATCH,
                    call_card.DISPATCH_WORST: hosts_mod.FORWARDED_DISPATCH,
                    call_card.CACHED_DISPATCH: hosts_mod.FORWARDED_CACHED}
#: the record layout's key words, as errors name them
_KEY_FIELDS = ("row bytes", "scale bytes", "top-k", "weights", "ranks per host", "experts without top-k")


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


def _words(t: Optional[Tensor], n: int, dev) -> Tensor:
    """``t`` (``[n, ...]``, any strides) as int32 ``[n, words]``; a one-word dummy for ``None``."""
    if t is None:
        return torch.zeros(1, dtype=torch.int32, device=dev)
    return dense(t).view(torch.uint8).view(n, t.element_size() * math.prod(t.shape[1:])).view(torch.int32)


def dense(t: Tensor) -> Tensor:
    """``t`` with row-major strides, a view where it has them. ``Tensor.contiguous()`` is not enough before a dtype
    view: a size-1 dimension may keep any stride (a column-major ``[n, 1]`` scale tensor, a single row), and
    ``view(dtype)`` of another element size needs the last stride to be 1."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


@dataclasses.dataclass
class _Streams:
    """What a rank sends each host in one exchange: a record stream per host (its own host's included, which
    stays on this rank), built by the network-leg kernels from ``src``."""
    rec: NetRecord
    src: net.Sources
    tokens: List[Tensor]        # per host: int64 rows of the sources, in stream order, on the device
    #: a dispatch without topk_idx: num_tokens_per_expert (int32 [E]); each host's slice goes to the RDMA peer
    #: there, which forwards the sums (the forwarding leg's per-expert counts)
    npe: Optional[Tensor] = None
    #: this rank's call as its RDMA peers compare it: ``(call-card code, value, ...)``
    #: (:mod:`triton_ep.protocol.call_card`; ``()``: none to compare)
    card: tuple = ()

    def count(self, host: int) -> int:
        return self.tokens[host].numel()


def network_record_bytes(row_bytes: int, scale_bytes: int, num_topk: int, weights: bool, ranks_per_host: int) -> int:
    """Bytes of one network-leg dispatch record (16-byte aligned): meta, an x row of ``row_bytes``, its
    ``scale_bytes``, ``num_topk`` int64 ids (and fp32 weights with ``weights``), and ``ranks_per_host`` bytes of
    ``is_token_in_rank``. A combine record is ``network_record_bytes(2 * hidden + 4 * num_topk, 0, 0, False, 0)``
    (the partial sum in bf16, then the weights' fp32 sums)."""
    return NetRecord(row_bytes, scale_bytes, num_topk, num_topk if weights else 0, ranks_per_host).nbytes


def traffic_stats(transport: Optional[str] = None, num_hosts: int = 1, sched_stats: Optional[dict] = None,
                  network_s: float = 0.0, exchanges: int = 0, host_exchanges: int = 0) -> dict:
    """``Buffer.get_rdma_stats``'s dict from the scheduler's :meth:`~triton_ep.scheduler.Scheduler.stats`
    (channels summed from its QPs); the defaults give a Buffer on one host: no traffic."""
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
            "host_exchanges": host_exchanges}


@dataclasses.dataclass
class _Plan:
    uid: str
    seq: int                        # the internode call number of the dispatch that made it
    num_tokens: int
    to_host: List[Tensor]           # per host: int64 indices of this rank's tokens sent there, ascending
    from_host: List[int]            # per host: rows this rank forwards for it
    local_handle: DispatchHandle    # the intranode dispatch of the forwarded rows
    order: Tensor                   # int64 [N]: received row i is intranode row order[i]
    num_rows: int                   # N (padding included)


class Internode:
    """Internode normal mode for one Buffer whose ranks span several hosts.

    Args:
        rt: the Buffer's :class:`~triton_ep.runtime.across_hosts.HostsRuntime` (``rt.hosts``: the hosts;
            ``rt.rdma_transport``: ``"verbs"`` or ``"emulated"``; ``rt.group``: the process group; ``rt.local``:
            this host's runtime, whose shared buffers carry the forwarding leg).
        num_qps_per_peer: RC QPs to each RDMA peer (placed over ports and ECMP paths).
        slots, slot_bytes: the scheduler's rings: chunks in flight per peer and bytes per chunk.
        low_latency: the Buffer's ``(low_latency_mode, num_rdma_bytes)``: checked equal on every rank here,
            before the low-latency set-up (whose exchanges only the ranks in low-latency mode make).
        Each ``None``: :func:`network_shape` (the environment, else the defaults); every rank must agree.

    Raises:
        NotImplementedError: ranks simulated in one process (internode mode needs a process group).
        ValueError: on every rank alike, where the ranks disagree on the network leg's shape, the capture path,
            ``low_latency_mode`` / ``num_rdma_bytes`` or the emulated fabric's delays, or a rank's
            ``TRITON_EP_RDMA_QPS_PER_PEER`` / ``_SLOTS`` / ``_CHUNK_BYTES``, ``TRITON_EP_INTERNODE_CAPTURE_PATH``,
            ``TRITON_EP_EMULATED_REORDER_S`` or ``TRITON_EP_EMULATED_SKEW_S`` is bad
            (naming that rank).
        EPTimeoutError / EPRemoteError: a rank did not take part in the set-up within ``rt.timeout_s``.
    """

    def __init__(self, rt, num_qps_per_peer: Optional[int] = None,
                 slots: Optional[int] = None, slot_bytes: Optional[int] = None, low_latency: tuple = (False, 0)) -> None:
        self.rt = rt
        self.hosts = hosts = rt.hosts
        if rt.group is None:
            raise NotImplementedError("internode mode needs a torch.distributed process group (ranks simulated "
                                      "in one process cannot span hosts)")
        me = rt.rank
        self.host, self.local_index = hosts.host_of[me], hosts.local_index(me)
        self.num_hosts, self.per_host = hosts.num_hosts, hosts.ranks_per_host
        #: the other hosts: each holds one RDMA peer of this rank
        self.peer_hosts = [h for h in range(self.num_hosts) if h != self.host]
        self.local_rt: Optional[Runtime] = None
        self.sched = self.transport = self._ring_mem = None
        #: int32 [num_hosts, per_host]: the global rank (is_token_in_rank column) of each host's local ranks
        self._cols = torch.tensor([list(hosts.ranks(h)) for h in range(self.num_hosts)], dtype=torch.int32,
                                  device=rt.device)
        #: the same, flat (``hosts.rank_order``): the columns of is_token_in_rank host by host; None: in order
        self._order = None if hosts.rank_order == tuple(range(rt.group_size)) else self._cols.view(-1)
        #: this Buffer's internode calls so far (equal on ranks in step, whether the calls succeeded or not):
        #: names a dispatch's handle (its plan's ``seq``) and stamps the disagreements posted in the call cards
        #: (:meth:`_skip_local`)
        self._calls = 0
        #: seconds this rank's calls spent in the network leg (packing, waiting, unpacking), and its exchanges
        self.network_s, self.exchanges = 0.0, 0
        #: exchanges through host memory (headers, statuses, counts): the host path's; the capture path makes none
        self.host_exchanges = 0
        try:
            # this host's ranks share their own buffers (the forwarding leg); nothing is mapped between hosts
            self.local_group, self.peer_group = rt.local_group, rt.peer_group
            self.local_rt = rt.local
            self.local = Intranode(self.local_rt)
            # (bad environment values are raised after the exchange, on every rank alike: the peers do not wait
            # out their timeout for this rank)
            try:
                env_shape = network_shape()
                shape = tuple(e if v is None else int(v)
                              for v, e in zip((num_qps_per_peer, slots, slot_bytes), env_shape))
            except ValueError as ex:
                shape = f"rank {me}: {ex}"
            raw = os.environ.get(ENV_CAPTURE_PATH, "").strip()
            capture = (None if not raw else raw == "1") if raw in ("", "0", "1") else \
                f"rank {me}: {ENV_CAPTURE_PATH}={raw!r} must be 0 or 1 (or unset)"
            mine = (uuid.uuid4().hex[:12], shape, capture, tuple(low_latency),
                    delays_to_exchange(rt.rdma_transport, me))
            every = gather_objects(rt.group, mine, rt.timeout_s, "internode: fabric token")
            hosts_mod.first_error([v for e in every for v in (e[1], e[2])])
            num_qps_per_peer, slots, slot_bytes = shape
            #: the emulated fabric's (reorder_s, skew_s) the ranks agreed on (None: verbs); the low-latency
            #: network leg takes them too (low_latency.open_internode_low_latency)
            self.delays = delays = agreed_delays([e[4] for e in every])
            hosts_mod.agreed("low_latency_mode and num_rdma_bytes", [e[3] for e in every])
            hosts_mod.agreed(f"the network leg's shape ({ENV_QPS}, {ENV_SLOTS}, {ENV_CHUNK})", [e[1] for e in every])
            hosts_mod.agreed(ENV_CAPTURE_PATH, [e[2] for e in every])
            #: the capture path (:class:`~triton_ep.modes.internode.capture.CapturePath`): its calls and state
            self.capture = CapturePath(self, capture)
            token = every[0][0]
            self.capture.open_store(rt.group, token)
            names = [f"ep{token}_{r}" for r in range(rt.group_size)]
            # the rings: host memory the proxy and the NIC see, pinned and device-mapped for GPU kernels
            leg = open_network(rt.rdma_transport, self.peer_group, self.host, self.num_hosts, token=token, names=names,
                               name=names[me], num_qps_per_peer=num_qps_per_peer, slots=slots, slot_bytes=slot_bytes,
                               timeout_s=rt.timeout_s, device=rt.device, delays=delays)
            self.transport, self.sched, self._ring_mem = leg.transport, leg.sched, leg.mem
            self._ring_ctrl, self._ring_send, self._ring_recv = leg.ring_ctl, leg.send, leg.recv
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the proxy, release the QPs, MRs, CQs and PD, and the host's shared buffers. Idempotent."""
        sched, transport, local_rt = self.sched, self.transport, self.local_rt
        self.sched = self.transport = self.local_rt = None
        self.local_group = self.peer_group = None       # the HostsRuntime destroys them
        try:
            if sched is not None:
                sched.close()
        finally:
            try:
                if transport is not None:
                    transport.close()
                self._ring_mem = self._ring_ctrl = self._ring_send = self._ring_recv = None
            finally:
                if local_rt is not None:
                    local_rt.close()

    def rdma_buffer(self) -> Tensor:
        """This rank's registered RDMA memory: uint8, the scheduler's control block, send ring and receive
        ring (``Buffer.get_local_buffer_tensor(..., use_rdma_buffer=True)``).

        Raises:
            EPError: the Buffer was destroyed.
        """
        if self._ring_mem is None:
            raise EPError(f"rank {self.rt.rank}: this Buffer was destroyed")
        return self._ring_mem

    def stats(self) -> dict:
        """Traffic since construction: the scheduler's bytes, work requests and chunks per QP (``"host/qp"``
        keys, with channel and port), bytes per port and per channel, and the network leg's seconds."""
        return traffic_stats(self.rt.rdma_transport, self.num_hosts,
                             self.sched.stats() if self.sched is not None else None, self.network_s, self.exchanges,
                             self.host_exchanges)

    # ------------------------------------------------------------------ layout
    def _live(self) -> None:
        """Raise at once where an earlier call failed: the Buffer destroyed (``EPError``), a kernel's
        recorded error, or the RDMA proxy's (sticky: every later call raises it, with global ranks). Where a
        capture-path call failed because ranks disagree, the first such error is that disagreement's
        ``ValueError`` (:meth:`~triton_ep.modes.internode.capture.CapturePath.translate_failure`)."""
        if self.sched is None:
            raise EPError(f"rank {self.rt.rank}: this Buffer was destroyed")
        try:
            self._live_checks()
        except Exception as ex:     # noqa: BLE001 - raised as it is, or as the disagreement behind it
            told = self.capture.translate_failure(ex)
            if told is not ex:
                raise told from ex
            raise

    def _live_checks(self) -> None:
        """:meth:`_live`'s checks, in order: the capture path's statuses, this host's runtime, the proxy."""
        self.capture.check()        # first: this rank's own recorded error names the cause, the others echo it
        try:
            self.rt.check()         # this host's runtime: also raises where its forwarding leg failed for good
        except EPError as ex:
            if self.local_rt.comm is not None and self.local_rt.comm.broken and self.sched.error is None:
                # the network's twin of _leave_host: the RDMA peers hear it from the fault word and raise at once
                self.sched.fail(EPRemoteError(f"rank {self.rt.rank}: the forwarding leg of host {self.host} failed "
                                              f"for good ({self.local_rt.comm.broken})"))
            self._annotate(ex)
            raise
        try:
            self.sched.check()
            self._ring_error()          # a ring kernel's wait that failed (the capture path's came unseen)
        except (sched_mod.ProxyError, EPTimeoutError) as ex:
            self._leave_host()
            raise self._global(ex) from ex

    def check(self) -> None:
        """``Buffer.check()`` across hosts: raise what the last calls recorded (this host's kernels, the RDMA
        proxy, the capture path's statuses), reading host memory only.

        Raises:
            EPError (EPTimeoutError, EPRemoteError, EPCapacityError...), ValueError: as the calls would.
        """
        self._live()

    def tokens_per_host(self, is_token_in_rank: Tensor) -> Tensor:
        """DeepEP's ``num_tokens_per_rdma_rank``: int32 ``[num_hosts]``, the tokens that go to at least one
        rank of each host, from ``is_token_in_rank`` bool ``[T, R]`` (on the device; no host wait)."""
        per_host = self._host_mask(is_token_in_rank)
        return per_host.sum(dim=0, dtype=torch.int32)

    def _host_mask(self, is_token_in_rank: Tensor) -> Tensor:
        """bool ``[T, num_hosts]``: token ``t`` goes to at least one rank of host ``h``."""
        in_rank = is_token_in_rank if self._order is None else is_token_in_rank.index_select(1, self._order)
        return in_rank.view(in_rank.shape[0], self.num_hosts, self.per_host).any(dim=2)

    def get_dispatch_layout(self, intranode: Intranode, topk_idx: Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """``Buffer.get_dispatch_layout`` across hosts: the layout of ``intranode`` (the Buffer's group-wide
        normal mode: the same kernel), plus ``num_tokens_per_rdma_rank`` int32 ``[num_hosts]`` second.
        Raises at once where an earlier call failed for good (:meth:`_live`)."""
        self._live()
        return intranode.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                             allocate_on_comm_stream, tokens_per_host=self.tokens_per_host)

    def check_tokens_per_host(self, num_tokens_per_rdma_rank: Optional[Tensor], required: bool) -> None:
        """Check ``num_tokens_per_rdma_rank`` (int32 ``[num_hosts]`` on the Buffer's device; ``required``:
        a dispatch without a handle needs it, as DeepEP's).

        Raises:
            ValueError / TypeError: missing where required, or the wrong dtype, shape or device.
        """
        if num_tokens_per_rdma_rank is None:
            if required:
                raise ValueError("dispatch across hosts needs num_tokens_per_rdma_rank (int32 [num_hosts], as "
                                 "get_dispatch_layout returned it) when no handle is given")
            return
        self.rt.check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, (torch.int32,),
                             (self.num_hosts,))

    # ------------------------------------------------------------------ the network leg
    def _exchange(self, streams: Optional[_Streams], err: Optional[BaseException] = None,
                  skip: Optional[str] = None) -> Tuple[Tensor, List[int], Optional[Tensor]]:
        """Send each host's record stream of ``streams`` to this rank's RDMA peer there and receive theirs:
        first a header (a status, the record count and the record layout, which must agree), then the
        records, through the network-leg kernels. A rank that failed (``err``) sends only its header. Where
        this rank or a peer failed, every rank of the exchange raises after the headers, and (with ``skip``,
        the kind of the forwarding leg still to come: ``"dispatch"`` or ``"cached"``) this rank first leaves
        that leg (:meth:`_skip_local`: its host's ranks stop at once and tell their own RDMA peers in turn).

        Returns: the records received, uint8 ``[n, rec.nbytes]`` on the device, one block per host in host
        order (this host's block is this rank's own stream for it), the blocks' record counts, and (with
        ``streams.npe``) int32 ``[ranks per host * E / R]``: this host's experts' counts summed over the
        sources this rank forwards for.
        Raises: ``err``; ``EPRemoteError`` / ``EPCapacityError`` naming the peer that failed; ``ValueError``
        where ranks disagree (this rank and its RDMA peer called differently, or a peer passes on a disagreement
        found elsewhere: :class:`~triton_ep.runtime.hosts.Disagreement`, naming the field and two ranks' values);
        the proxy's and the ring kernels' errors (``EPTimeoutError`` naming the peer and the chunk).
        """
        try:
            with self._network():
                counts = self._headers(streams, err)
                if err is None:
                    npe = None if streams.npe is None else self._expert_counts(streams.npe)
                    return self._move(streams, counts), counts, npe
            raise err
        except BaseException as ex:
            if skip is not None:
                self._skip_local(skip, ex)
            raise

    @contextlib.contextmanager
    def _network(self):
        """One exchange with the RDMA peers: counted and timed (:meth:`stats`), the scheduler's errors given
        global ranks and hosts."""
        t0 = time.perf_counter()
        try:
            yield
        except (sched_mod.ProxyError, EPTimeoutError) as ex:
            if self.sched is not None and self.sched.error is not None:
                self._leave_host()
            raise self._global(ex) from ex
        finally:
            self.network_s += time.perf_counter() - t0
            self.exchanges += 1

    def _local_run(self, gen, forwarded: bool = False):
        """Run an intranode call of this host's ranks (``forwarded``: the forwarding leg's dispatch of records,
        whose call-card fields are then named as the records', :data:`hosts.FORWARDED_DISPATCH`). Its errors
        number the host's ranks from 0: they get global rank numbers. A disagreement the
        host's ranks found, or one a rank of the host found with its RDMA peer and posted before it failed its
        part of this call (:meth:`_skip_local`), is raised as a ``ValueError`` naming it (with
        ``ex.disagreement``, which the header exchange passes on)."""
        try:
            return self.local_rt.run(gen)
        except (EPError, ValueError) as ex:     # (a disagreement of the host's ranks is a ValueError)
            d = self._host_disagreement(forwarded)
            if d is not None:
                raise d.error(self.rt.rank) from ex
            self._annotate(ex)
            raise

    def _host_disagreement(self, forwarded: bool = False) -> Optional[hosts_mod.Disagreement]:
        """What this host's ranks disagree on in the running call: one they posted (:meth:`_skip_local`), else
        the first difference between their call cards of this call (local rank 0's against the others', in
        rank order: the same on every rank of the host), else ``None``."""
        comm = self.local_rt.comm if self.local_rt is not None else None
        if comm is None or comm.ctrl is None:
            return None
        ranks = self.hosts.ranks(self.host)
        cards = [comm.card(i) for i in range(len(ranks))]
        for c in cards:
            d = hosts_mod.Disagreement.posted(c, self._calls)
            if d is not None:
                return d
        base = cards[0]
        for i in range(1, len(ranks)):
            c = cards[i]
            if int(c[0]) != int(base[0]):       # (not at the same call: a rank that failed before its card)
                continue
            vals = [[int(v) for v in card_[1:call_card.FAILED_WORD]] for card_ in (base, c)]
            if forwarded:       # (the forwarding leg's dispatches move records: their fields say so)
                vals = [[_FORWARDED_CODES.get(v[0], v[0])] + v[1:] for v in vals]
            d = hosts_mod.Disagreement.of_cards(vals[0], vals[1], ranks[0], ranks[i])
            if d is not None:
                return d
        return None

    def _annotate(self, ex: EPError) -> None:
        """Give an error of this host's intranode runtime, which numbers the host's ranks from 0, global rank
        numbers: in its message, its ``rank`` / ``peer`` / ``peers`` (``EPTimeoutError``) and, for a failure
        word, ``ex.culprit`` (the global rank that posted it, passed on in the status header). Once per error."""
        if getattr(ex, "_ep_global", False):
            return
        ex._ep_global = True
        ranks = list(self.hosts.ranks(self.host))

        def glob(r):
            return ranks[r] if isinstance(r, int) and 0 <= r < len(ranks) else r
        failed = getattr(ex, "failed_rank", None)
        if failed is not None and 0 <= failed < len(ranks) and not hasattr(ex, "culprit"):
            ex.culprit = ranks[failed]
        for name in ("rank", "peer"):
            if isinstance(getattr(ex, name, None), int):
                setattr(ex, name, glob(getattr(ex, name)))
        if isinstance(getattr(ex, "peers", None), list):
            ex.peers = [glob(r) for r in ex.peers]
        if ex.args and isinstance(ex.args[0], str):
            ex.args = (f"{hosts_mod.global_ranks(ex.args[0], ranks)} (in the forwarding leg of host {self.host}: "
                       f"ranks {ranks})",) + ex.args[1:]

    def _leave_host(self, err: Optional[BaseException] = None) -> None:
        """The network leg failed for good (the scheduler's error is sticky): leave this host's group, so
        its ranks' later calls and re-synchronisations raise at once instead of waiting for this rank.
        ``err`` an ``EPCapacityError``: the ``GONE`` word says so, and a rank of the host that hears of it
        before finding it itself raises ``EPCapacityError`` as well."""
        if self.local_rt is not None and self.local_rt.sig is not None:
            stage = STAGE_CAPACITY if isinstance(err, EPCapacityError) else int(kernels.flags.STAGE_FAILED)
            self.local_rt.sig.leave(stage)

    def _skip_local(self, kind: str, err: Optional[BaseException] = None) -> None:
        """This rank leaves the running call before its host's intranode leg (``kind``: ``"dispatch"``,
        ``"cached"`` or ``"combine"``): it still takes that call's steps and fails at their argument check,
        as a rank of one host that rejects its arguments does, so the ranks of its host that wait for it stop
        at once (its failure word: they raise ``EPRemoteError``) and every rank's call counters stay in step.
        What that local call raises is dropped: the caller raises this rank's own error ``err``. Where ``err`` is
        a disagreement (``err.disagreement``), it is first posted in this rank's call card, so the host's ranks
        raise it too (:meth:`_local_run`), not ``EPRemoteError``."""
        if self.local_rt is None or self.local_rt.comm is None:
            return
        d = getattr(err, "disagreement", None)
        if d is not None and self.local_rt.comm.ctrl is not None:
            d.post(self.local_rt.comm.card(self.local_index), self._calls)
        steps = {"dispatch": lambda: self.local.dispatch_steps(None),
                 "cached": lambda: self.local.dispatch_steps(None, handle=_SKIP),
                 "combine": lambda: self.local.combine_steps(None, _SKIP)}[kind]
        try:
            self.local_rt.run(steps())
        except Exception:   # noqa: BLE001 - the expected argument error, or the host's earlier failure
            pass

    def _status(self, err: Optional[BaseException]) -> None:
        """After the forwarding leg: tell the RDMA peers whether this rank's part succeeded and hear theirs
        (every rank of a host fails such a leg alike, so each rank hears of a host that failed from its own
        peer there). Raises ``err``, else the first peer's failure."""
        with self._network():
            self._headers(None, err)
        if err is not None:
            raise err

    def _headers(self, streams: Optional[_Streams], err: Optional[BaseException] = None) -> List[int]:
        """The header exchange of :meth:`_exchange` (``streams`` ``None``: a status alone; ``err``: this rank
        failed, and says so). Returns the record counts per host (this host's: its own stream's); raises the
        peers' failures (not ``err``: the caller raises it outside the network's error translation)."""
        self.capture.sync_host_path()
        self.host_exchanges += 1
        peers = self.peer_hosts
        key = (0,) * _KEY_WORDS if streams is None else \
            streams.rec.key() + (0 if streams.npe is None else streams.npe.shape[0],)
        mine = tuple(streams.card) if streams is not None and err is None else ()
        told = getattr(err, "disagreement", None)
        code = _OK if err is None else (_CAPACITY if isinstance(err, EPCapacityError) else
                                        _MISMATCH if told is not None else _FAILED)
        # the rank whose own error started a failure (-1: unknown, e.g. heard in a host's forwarding leg)
        culprit = -1 if err is None else getattr(err, "culprit", -1 if isinstance(err, EPError) else self.rt.rank)
        tail = [*key, *mine, *[0] * (_CARD_WORDS - len(mine)),
                *(told.words() if told is not None else [0] * hosts_mod.Disagreement.WORDS)]
        head = {h: np.array([code, 0 if streams is None or err is not None else streams.count(h), culprit, *tail],
                            np.int64).view(np.uint8) for h in peers}
        got = sched_mod.host_alltoall(self.sched, head, {h: 8 * HEADER_WORDS for h in peers})
        words = {h: got[h].view(np.int64) for h in peers}
        for h in peers:     # a capture-path stream read as a header: the ranks took different paths
            if err is None and not (_OK <= words[h][0] <= _MISMATCH and words[h][1] >= 0
                                    and -1 <= words[h][2] < self.rt.group_size):
                raise ValueError(f"rank {self.rt.rank}: rank {self._peer_rank(h)} (host {h}) sent no header this "
                                 f"call can read: the ranks made different calls (num_worst_tokens > 0 on every "
                                 f"rank, or on none; TRITON_EP_INTERNODE_CAPTURE_PATH the same on every rank)")
        if err is not None:
            return [0] * self.num_hosts
        for h in peers:     # a disagreement found anywhere is this call's error on every rank
            d = hosts_mod.Disagreement.of_words(words[h][-hosts_mod.Disagreement.WORDS:]) \
                if words[h][0] == _MISMATCH else None
            if d is not None:
                raise d.error(self.rt.rank)
        for h in peers:
            if words[h][0]:
                peer, first = self._peer_rank(h), int(words[h][2])
                who = f"rank {peer} (host {h})"
                if first >= 0 and first != peer:
                    who = f"rank {first} (host {self.hosts.host_of[first]}; rank {peer} on host {h} passed it on)"
                if words[h][0] == _CAPACITY:
                    ex = EPCapacityError(f"rank {self.rt.rank}: {who} found more rows than num_worst_tokens on its "
                                         f"host; no rank returns from this dispatch")
                else:
                    ex = EPRemoteError(f"rank {self.rt.rank}: {who} failed this call (its own error names why); "
                                       f"this rank stopped too")
                ex.culprit = first if first >= 0 else peer
                raise ex
        for h in peers:     # the RDMA peers compare their calls (the lower rank first, on both sides)
            theirs = [int(w) for w in words[h][3 + _KEY_WORDS:3 + _KEY_WORDS + _CARD_WORDS]]
            if mine and theirs[0]:
                d = hosts_mod.Disagreement.of_cards(mine, theirs, self.rt.rank, self._peer_rank(h))
                if d is not None:
                    raise d.error(self.rt.rank)
        for h in peers:     # (calls that agree give records of one layout: this names what still differs)
            there = tuple(int(w) for w in words[h][3:3 + _KEY_WORDS])
            if streams is not None and there != key:
                diff = "; ".join(f"{n}: rank {self._peer_rank(h)} sends {a}, rank {self.rt.rank} sends {b}"
                                 for n, a, b in zip(_KEY_FIELDS, there, key) if a != b)
                raise ValueError(f"rank {self.rt.rank}: ranks disagree across hosts on the records of this call "
                                 f"({diff}): the ranks called with different arguments")
        counts = [0] * self.num_hosts
        for h in peers:
            counts[h] = int(words[h][1])
        if streams is not None:
            counts[self.host] = streams.count(self.host)
        return counts

    def _expert_counts(self, npe: Tensor) -> Tensor:
        """A dispatch without ``topk_idx``: send each RDMA peer the counts of its host's experts in ``npe``
        (int32 ``[E]``) and return this host's experts' counts summed over this rank and its peers (int32
        ``[ranks per host * E / R]``, on the device): what this rank's forwarding leg delivers."""
        n = npe.shape[0] // self.num_hosts
        self.host_exchanges += 1
        mine = npe.to(torch.int64).cpu().numpy()
        got = sched_mod.host_alltoall(self.sched, {h: mine[h * n:(h + 1) * n].view(np.uint8) for h in self.peer_hosts},
                                      {h: 8 * n for h in self.peer_hosts})
        total = mine[self.host * n:(self.host + 1) * n].copy()
        for h in self.peer_hosts:
            total += got[h].view(np.int64)
        return torch.from_numpy(total.astype(np.int32)).to(self.rt.device)

    def _peer_rank(self, host: Optional[int]) -> Optional[int]:
        """The global rank of this rank's RDMA peer on ``host`` (the scheduler numbers its peers by host)."""
        return None if host is None else self.hosts.ranks(host)[self.local_index]

    def _global(self, ex: BaseException) -> BaseException:
        """The scheduler's error with global ranks and host numbers in it (its ranks are host indices)."""
        where = f"internode, host {self.host} of {self.num_hosts}"
        if isinstance(ex, sched_mod.ProxyError):
            peer = self._peer_rank(ex.peer)
            why = f"{ex.why} ({where}; the peer is rank {peer} on host {ex.peer})" if peer is not None else \
                f"{ex.why} ({where})"
            return type(ex)(self.rt.rank, peer, ex.channel, ex.qp, ex.stage, why)
        peers = [self._peer_rank(p) for p in ex.peers]
        return EPTimeoutError(self.rt.rank, peers, f"{ex.stage} ({where}; waiting for host(s) "
                              f"{', '.join(str(p) for p in ex.peers)})", ex.timeout_s, ex.channel)

    def _move(self, st: _Streams, counts: List[int]) -> Tensor:
        """The records of :meth:`_exchange`: this host's own block by :func:`net.pack_linear`, the peers'
        through the rings in rounds of ``slots`` chunks per peer (pack, then unpack; the proxy carries them).
        Returns uint8 ``[sum(counts), rec.nbytes]`` on the device."""
        sched, dev, rec = self.sched, self.rt.device, st.rec
        rw = rec.nbytes // 4
        starts = np.cumsum([0] + counts)
        out = torch.empty(int(starts[-1]) * rw, dtype=torch.int32, device=dev)
        net.pack_linear(out[int(starts[self.host]) * rw:], st.src, st.tokens[self.host], self.host)
        S, SW = sched.slots, sched.slot_bytes // 4
        peers = self.peer_hosts
        tx_words = [st.count(h) * rw for h in range(self.num_hosts)]
        rx_words = [counts[h] * rw for h in range(self.num_hosts)]
        ntx = {h: cdiv(tx_words[h], SW) for h in peers}
        nrx = {h: cdiv(rx_words[h], SW) for h in peers}
        tx0, rx0 = sched.reserve(ntx, nrx)
        rounds = max([cdiv(max(ntx[h], nrx[h]), S) for h in peers] + [0])
        if rounds:
            def i64(vals):
                return torch.tensor(vals, dtype=torch.int64, device=dev)
            tok_n = [st.count(h) for h in range(self.num_hosts)]
            tokens = torch.cat([t.to(dev, torch.int64) for t in st.tokens])
            tok_start = i64(np.cumsum([0] + tok_n)[:-1].tolist())
            n_tx, n_rx = i64(tx_words), i64(rx_words)
            f_tx = i64([tx0.get(h, 0) for h in range(self.num_hosts)])
            f_rx = i64([rx0.get(h, 0) for h in range(self.num_hosts)])
            out_start = i64((starts[:-1] * rw).tolist())
            self._rounds(rounds, st.src, tokens, tok_start, n_tx, f_tx, out, out_start, n_rx, f_rx, wait=True)
        return out.view(torch.uint8).view(int(starts[-1]), rec.nbytes)

    def _rounds(self, rounds: int, src: net.Sources, tokens: Tensor, tok_start: Tensor, n_tx: Tensor, f_tx: Tensor,
                out: Tensor, out_start: Tensor, n_rx: Tensor, f_rx: Tensor, wait: bool = False,
                dev: Optional[net.DeviceCounts] = None) -> None:
        """Launch ``rounds`` rounds of the ring kernels (:func:`net.pack_ring`, then :func:`net.unpack_ring`,
        arguments as theirs), under the interpreter with the stall watchdog as their bound; with ``wait``,
        wait for them on the device. Then raise the proxy's error or a ring kernel's recorded one (failing
        the scheduler for good)."""
        sched = self.sched
        S = sched.slots
        common = dict(me_host=self.host, num_hosts=self.num_hosts, slots=S, slot_bytes=sched.slot_bytes,
                      timeout_s=self.rt.timeout_s, dev=dev)
        guard = (stall_watchdog(sched.flags.w, int(kernels.flags.RING_ABORT), self.rt.timeout_s,
                                self._ring_progress) if interpreted() else contextlib.nullcontext())
        with guard:
            for i in range(rounds):
                net.pack_ring(self._ring_ctrl, self._ring_send, src, tokens, tok_start, n_tx, f_tx, i * S, (i + 1) * S,
                              **common)
                net.unpack_ring(self._ring_ctrl, self._ring_recv, out, out_start, n_rx, f_rx, i * S, (i + 1) * S,
                                **common)
            if wait:
                self._wait_device()
        sched.check()
        self._ring_error()

    def _ring_error(self) -> None:
        """Raise a ring kernel's recorded error (a wait that ran out of time or was aborted), failing the
        scheduler for good first (host memory only)."""
        ex = self.sched.flags.error(self.rt.timeout_s)
        if ex is not None:
            self.sched.fail(ex)
            raise ex

    def _ring_progress(self) -> int:
        """The sum of the ring's chunk counters (every wait of the ring kernels advances one when it ends)."""
        f = self.sched.flags
        return sum(f.get(a, h) for a in (f.READY, f.SENT, f.TAIL, f.HEAD) for h in self.peer_hosts)

    def _wait_device(self) -> None:
        """Wait (bounded; polling, so the proxy threads keep the GIL) for the kernels queued on the device."""
        if self.rt.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record()
        bound = 2 * self.rt.timeout_s + 10.0
        deadline = time.monotonic() + bound
        while not done.query():
            if time.monotonic() > deadline:
                raise EPTimeoutError(self.rt.rank, [], "internode network leg (the ring kernels did not finish)",
                                     bound)
            time.sleep(0.0002)

    def _sources(self, rec: NetRecord, n: int, x: Tensor, sc: Optional[Tensor] = None, ids: Optional[Tensor] = None,
                 w: Optional[Tensor] = None, in_rank: Optional[Tensor] = None) -> net.Sources:
        """The network-leg kernels' view of ``n`` source rows: ``x`` (``[n, ...]``, ``rec.row`` bytes a row),
        scales, int64 ids, fp32 weights and bool ``is_token_in_rank`` ``[n, R]`` (each ``None`` where ``rec``
        has no such field)."""
        dev = self.rt.device
        loc = torch.zeros(1, dtype=torch.uint8, device=dev) if in_rank is None else \
            in_rank.contiguous().view(torch.uint8)
        return net.Sources.of(rec, _words(x, n, dev), _words(sc, n, dev), _words(ids, n, dev), _words(w, n, dev), loc,
                              0 if in_rank is None else in_rank.shape[1], self._cols, self.rt.rank)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, intranode: Intranode, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """``Buffer.dispatch`` across hosts (same arguments and results; the handle is an
        :class:`InternodeHandle`). ``intranode``: the Buffer's group-wide normal mode (its checks of ``x``).

        Raises:
            ValueError / TypeError: bad arguments (``num_tokens_per_rdma_rank`` other than the tokens sent to
            each host included), before anything moves; EPTimeoutError / ProxyError: a peer or the RDMA proxy
            did not answer within ``timeout_s``.
        """
        self._calls += 1
        self._live()
        if self.capture.takes(num_worst_tokens, handle):
            return self.capture.dispatch(intranode, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                         is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                         expert_alignment, num_worst_tokens, previous_event)
        prep = err = None
        try:
            prep = self._prepare_dispatch(intranode, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                          expert_alignment, num_worst_tokens, previous_event)
        except Exception as e:   # noqa: BLE001 - the RDMA peers and this host's ranks are told, then it is raised
            err = e
        kind = "dispatch" if handle is None else "cached"
        fwd, counts, npe_f = self._exchange(prep.streams if prep else None, err, skip=kind)
        result = err = None
        try:
            result = self._forward(prep, fwd, counts, npe_f, expert_alignment, num_worst_tokens)
        except Exception as e:   # noqa: BLE001 - the RDMA peers hear of it (their hosts' ranks then fail alike)
            err = e
            if not prep.local_started:      # this host's ranks wait for this rank's part of the leg
                self._skip_local(kind, e)
        self._status(err)
        return result

    def _prepare_dispatch(self, intranode, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                          num_worst_tokens, previous_event) -> SimpleNamespace:
        """Check a dispatch's arguments and pack its records for each host (nothing moves yet)."""
        if handle is not None:
            xv, sc, plan, rec, src = self._cached_args(intranode, x, handle, topk_idx, topk_weights, previous_event)
            streams = _Streams(rec, src, plan.to_host, card=(
                call_card.CACHED_DISPATCH, call_card.dtype_code(xv.dtype), xv.shape[1],
                call_card.dtype_code(None if sc is None else sc.dtype), 0 if sc is None else sc.shape[1], plan.seq))
            return SimpleNamespace(xv=xv, sc=sc, rec=rec, streams=streams, plan=plan, local_started=False)
        self.check_tokens_per_host(num_tokens_per_rdma_rank, required=True)
        # the group-wide checks of intranode mode (R = every rank of every host)
        a = intranode.dispatch_args(x, None, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                    topk_weights, expert_alignment, num_worst_tokens, previous_event)
        xv, sc, idx, w, E, K = a.x, a.scales, a.topk_idx, a.topk_weights, a.num_experts, a.num_topk
        if idx is not None:
            bad = idx[(idx < -1) | (idx >= E)]
            if bad.numel():
                raise ValueError(f"rank {self.rt.rank}: topk_idx holds ids outside [-1, {E}): {bad[:8].tolist()}")
            in_rank = kernels.routing_layout(idx, E, self.rt.group_size)[2]
        else:                       # routed by is_token_in_rank, counted by num_tokens_per_expert as given
            in_rank = a.is_token_in_rank
            if (a.num_tokens_per_expert < 0).any():
                raise ValueError(f"rank {self.rt.rank}: num_tokens_per_expert holds negative counts (without "
                                 f"topk_idx the given counts are used as they are)")
        host_mask = self._host_mask(in_rank)
        want = host_mask.sum(dim=0, dtype=torch.int32)
        if not torch.equal(num_tokens_per_rdma_rank.to(want.device), want):
            raise ValueError(f"rank {self.rt.rank}: num_tokens_per_rdma_rank {num_tokens_per_rdma_rank.tolist()} "
                             f"differs from the tokens this rank sends to each host {want.tolist()} (by "
                             f"{'topk_idx' if idx is not None else 'is_token_in_rank'}); pass what "
                             f"get_dispatch_layout returned")
        to_host = [torch.nonzero(host_mask[:, h], as_tuple=True)[0] for h in range(self.num_hosts)]
        rec = self._record(xv, sc, K, 0 if w is None else K, self.per_host)
        streams = _Streams(rec, self._sources(rec, xv.shape[0], xv, sc, None if idx is None else idx.long(), w,
                                              in_rank), to_host,
                           None if idx is not None else a.num_tokens_per_expert, card=(
                               call_card.DISPATCH_WORST if num_worst_tokens else call_card.DISPATCH,
                               call_card.dtype_code(xv.dtype), xv.shape[1],
                               call_card.dtype_code(None if sc is None else sc.dtype), 0 if sc is None else sc.shape[1],
                               K, int(w is not None), E))
        return SimpleNamespace(xv=xv, sc=sc, rec=rec, streams=streams, plan=None, idx=idx, E=E, in_rank=in_rank,
                               to_host=to_host, local_started=False)

    def _cached_args(self, intranode, x, handle, topk_idx, topk_weights, previous_event):
        """Check a cached dispatch's arguments. Returns its rows (and scales), its handle's plan, its record
        layout (no ids, weights or is_token_in_rank bytes) and the records' sources."""
        check_event(previous_event)
        xv, sc = intranode.check_x(x)
        plan = self._check_handle(handle)
        check_cached_dispatch(xv.shape[0], plan.num_tokens, topk_idx, topk_weights)
        rec = self._record(xv, sc)
        return xv, sc, plan, rec, self._sources(rec, xv.shape[0], xv, sc)

    @staticmethod
    def _record(xv: Tensor, sc: Optional[Tensor], ids: int = 0, weights: int = 0, local: int = 0) -> NetRecord:
        """The record layout of a dispatch of rows ``xv`` with scales ``sc`` (fp32 / int32 ``[T, S]`` or
        ``None``); a cached dispatch carries no ids, weights or is_token_in_rank bytes."""
        return NetRecord(xv.shape[1] * xv.element_size(), 0 if sc is None else sc.shape[1] * 4, ids, weights, local)

    def _forward(self, prep: SimpleNamespace, fwd: Tensor, counts: List[int], npe_f: Optional[Tensor],
                 expert_alignment: int, num_worst_tokens: int) -> tuple:
        """The forwarding leg (the intranode dispatch of ``fwd``, the records this rank received over the
        network and its own for its host, uint8 ``[F, nbytes]``) and the results in DeepEP's order.
        ``npe_f``: without ``topk_idx``, the per-expert counts of the forwarded rows (from the sources)."""
        xv, sc, rec = prep.xv, prep.sc, prep.rec
        x_f, sc_f, ids_f, w_f, in_f = self._split(fwd, rec, xv.dtype, None if sc is None else sc.dtype)
        xs_f = x_f if sc_f is None else (x_f, sc_f)
        if prep.plan is not None:              # cached: the same routes, new rows
            prep.local_started = True
            return self._forward_cached(xs_f, prep.plan, xv)
        E, idx, T = prep.E, prep.idx, xv.shape[0]
        dev = self.local_rt.device
        ids_local = None
        if idx is not None:
            ids_local, npe_f = self._local_experts(ids_f.to(dev), E, idx.dtype)
        per_rank_f = in_f.sum(0, dtype=torch.int32)
        prep.local_started = True
        out = self._local_run(self.local.dispatch_steps(
            xs_f, None, per_rank_f.to(dev), None, in_f.to(dev), npe_f.to(dev), ids_local, w_f,
            expert_alignment, num_worst_tokens), forwarded=True)
        recv_x_f, recv_idx, recv_w, per_expert_list, local_handle, _ = out
        x_ret, order, src_meta, recv_from = self._in_rank_order(recv_x_f, local_handle, xv)
        n_rows = order.shape[0]
        to_host, in_rank = prep.to_host, prep.in_rank
        if self.capture.mode:      # its cached dispatches and combines: no host wait, no host exchange
            plan = CapturePlan.of_plain(self.rt.uid, self._calls, T, to_host, counts, local_handle, order)
        else:
            plan = _Plan(self.rt.uid, self._calls, T, to_host, counts, local_handle, order, n_rows)
        head = torch.full((T, self.num_hosts), -1, dtype=torch.int32, device="cpu")
        for h in range(self.num_hosts):
            head[to_host[h].cpu(), h] = torch.arange(to_host[h].numel(), dtype=torch.int32, device="cpu")
        cnt = torch.tensor(counts, dtype=torch.int32, device="cpu")
        new_handle = InternodeHandle((
            in_rank, torch.tensor([t.numel() for t in to_host], dtype=torch.int32, device="cpu").view(-1, 1),
            in_rank.sum(0, dtype=torch.int32).view(-1, 1), cnt.view(-1, 1), torch.cumsum(cnt, 0, dtype=torch.int32),
            recv_from.view(-1, 1), torch.cumsum(recv_from, 0, dtype=torch.int32), src_meta, head.to(xv.device),
            local_handle[5]), plan)
        return (x_ret, recv_idx[order] if recv_idx is not None else None,
                recv_w[order] if recv_w is not None else None, per_expert_list, new_handle, EventOverlap(None))

    def _local_experts(self, ids_f: Tensor, num_experts: int, dtype, valid: Optional[Tensor] = None):
        """The forwarded rows' top-k ids (int64 ``[F, K]``, global expert ids) as ids of this host's experts
        (``dtype``, ``-1`` for the others, and for every id of a row not ``valid``, bool ``[F]``), and the
        rows per host expert (int32 ``[ranks per host * E / R]``); no host synchronisation."""
        n = self.per_host * (num_experts // self.rt.group_size)
        base = self.host * n
        keep = (ids_f >= base) & (ids_f < base + n)
        if valid is not None:
            keep = keep & valid[:, None]
        ids_local = torch.where(keep, ids_f - base, -1).to(dtype)
        npe = torch.zeros(n, dtype=torch.int32, device=ids_f.device)
        npe.scatter_add_(0, ids_local.clamp(min=0).view(-1).long(), keep.view(-1).to(torch.int32))
        return ids_local, npe

    def _forward_cached(self, xs_f, plan, xv: Tensor) -> tuple:
        """A cached dispatch's forwarding leg: the intranode cached dispatch of ``xs_f`` (the forwarded records'
        ``x`` as :meth:`_split` gives it, with scales where there are) by ``plan``'s local handle, its rows put
        in ``plan.order`` as ``xv``'s dtype and hidden size. Returns DeepEP's six results."""
        recv = self._local_run(self.local.dispatch_steps(xs_f, handle=plan.local_handle), forwarded=True)[0]
        recv_xf = recv[0] if isinstance(recv, tuple) else recv
        x_out = self._rows(recv_xf, xv.dtype, xv.shape[1])[plan.order]
        if isinstance(recv, tuple):
            x_out = (x_out, recv[1][plan.order])
        return x_out, None, None, None, None, EventOverlap(None)

    def _in_rank_order(self, recv_x_f, local_handle, xv: Tensor):
        """The forwarding leg's received rows (``recv_x_f``: uint8 ``[N, 16 + row]``, or that with scales) in
        DeepEP's order: by global source rank, stable (the source's token order); padding rows last.
        Returns the rows as ``xv``'s dtype (with their scales), the order (int64 ``[N]``), each row's (source
        rank, source token) int32 ``[N, 2]`` (``-1``: padding) and the rows from each rank int32 ``[R]``; no
        host synchronisation."""
        R = self.rt.group_size
        recv_xf = recv_x_f[0] if isinstance(recv_x_f, tuple) else recv_x_f
        recv_sc = recv_x_f[1] if isinstance(recv_x_f, tuple) else None
        # padding rows (num_worst_tokens) carry no record
        meta = torch.where((local_handle[3] < 0)[:, None], -1, record_meta(recv_xf))
        order = torch.sort(torch.where(meta[:, 0] >= 0, meta[:, 0].long(), R), stable=True)[1]
        x_out = self._rows(recv_xf, xv.dtype, xv.shape[1])[order]
        x_ret = x_out if recv_sc is None else (x_out, recv_sc[order])
        src_meta = meta[order][:, :2].contiguous()
        got = src_meta[:, 0] >= 0
        recv_from = torch.zeros(R, dtype=torch.int32, device=src_meta.device)
        recv_from.scatter_add_(0, torch.where(got, src_meta[:, 0], 0).long(), got.to(torch.int32))
        return x_ret, order, src_meta, recv_from

    def _split(self, fwd: Tensor, rec: NetRecord, dtype, sc_dtype):
        """The forwarded rows as the intranode dispatch takes them: ``x`` uint8 ``[F, 16 + row]`` (meta, then
        the row's bytes), scales, ids int64 ``[F, K]``, weights fp32 ``[F, K]`` or ``None``, is_token_in_rank
        bool ``[F, per_host]``."""
        dev = self.local_rt.device
        x_f = byte_columns(fwd, 0, rec.span("row")[1], torch.uint8).to(dev)        # meta, then the row
        sc_f = record_field(rec, fwd, "scales", sc_dtype).to(dev) if rec.scales else None
        ids = record_field(rec, fwd, "ids", torch.int64).to(dev) if rec.ids else None
        w = record_field(rec, fwd, "weights", torch.float32).to(dev) if rec.weights else None
        in_f = record_field(rec, fwd, "local", torch.bool).to(dev) if rec.local else None
        return x_f, sc_f, ids, w, in_f

    @staticmethod
    def _rows(recv_xf: Tensor, dtype, hidden: int) -> Tensor:
        """The x rows of received records (uint8 ``[N, 16 + row]``) as ``dtype`` ``[N, hidden]``."""
        return byte_columns(recv_xf, NET_META_BYTES, recv_xf.shape[1], dtype)

    def _check_handle(self, handle) -> _Plan:
        plan = getattr(handle, "plan", None)
        if not isinstance(handle, InternodeHandle) or not isinstance(plan, (_Plan, CapturePlan)) or \
                plan.uid != self.rt.uid:
            raise ValueError("handle must be the handle of an internode dispatch of this Buffer")
        return plan

    # ------------------------------------------------------------------ combine
    def combine(self, x: Tensor, handle, topk_weights: Optional[Tensor] = None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """``Buffer.combine`` across hosts (same arguments and results): the rows are summed inside each host
        (fp32, ascending local rank, rounded to bf16), returned over the network once, and summed on this
        rank over hosts in ascending order (fp32, plus the biases, rounded once to bf16).

        Raises:
            TypeError / ValueError: bad arguments or a handle of another Buffer; EPTimeoutError / ProxyError:
            as ``dispatch``.
        """
        self._calls += 1
        self._live()
        if self.capture.takes(handle=handle):
            return self.capture.combine(x, handle, topk_weights, bias, previous_event)
        prep = err = None
        try:
            prep = self._prepare_combine(x, handle, topk_weights, bias, previous_event)
        except Exception as e:   # noqa: BLE001 - this host's ranks and the RDMA peers are told, then it is raised
            err = e
            self._skip_local("combine")
        streams = None
        if err is None:
            try:
                streams = self._reduce_in_host(prep)
            except Exception as e:   # noqa: BLE001 - the RDMA peers hear of it (this host's ranks failed alike)
                err = e
                if not prep.local_started:      # this host's ranks wait for this rank's part of the leg
                    self._skip_local("combine", e)
        got, counts, _ = self._exchange(streams, err)
        plan, H, K, rec = prep.plan, prep.H, prep.K, streams.rec
        dev = prep.xv.device
        acc = torch.zeros(plan.num_tokens, H, dtype=torch.float32, device=dev)
        wacc = torch.zeros(plan.num_tokens, K, dtype=torch.float32, device=dev) if K else None
        starts = np.cumsum([0] + counts)
        for h in range(self.num_hosts):          # ascending host order; each token at most once per host
            t = plan.to_host[h].to(dev)
            blk = got[int(starts[h]):int(starts[h + 1])]
            acc[t] += record_field(rec, blk, "row", torch.bfloat16)[:, :H].float()
            if K:
                wacc[t] += record_field(rec, blk, "weights", torch.float32)
        for b in prep.biases:
            acc += b.float()
        return (acc.to(torch.bfloat16), wacc, EventOverlap(None))

    def _prepare_combine(self, x, handle, topk_weights, bias, previous_event) -> SimpleNamespace:
        """Check a combine's arguments."""
        check_event(previous_event)
        plan = self._check_handle(handle)
        N = plan.num_rows
        xv = self.rt.check_tensor("x", x, (torch.bfloat16,), (N, None), f"N = {N} rows the dispatch delivered")
        H = xv.shape[1]
        wv, K = None, 0
        if topk_weights is not None:
            wv = self.rt.check_tensor("topk_weights", topk_weights, (torch.float32,), (N, None), f"N = {N} rows")
            K = wv.shape[1]
        biases = () if bias is None else (bias if isinstance(bias, tuple) else (bias,))
        for b in biases:
            self.rt.check_tensor("bias", b, (torch.bfloat16,), (plan.num_tokens, H), f"T = {plan.num_tokens}, H = {H}")
        return SimpleNamespace(plan=plan, xv=xv, wv=wv, H=H, K=K, biases=biases, local_started=False)

    def _reduce_in_host(self, prep: SimpleNamespace) -> _Streams:
        """The intranode combine of this host's rows (per forwarded token: the fp32 sum over the host's ranks,
        rounded to bf16), as record streams to each source host (rows padded to 4 bytes)."""
        plan = prep.plan
        rec, src, rows = self._combine_in_host(prep)
        starts = np.cumsum([0] + plan.from_host)
        tokens = [rows[int(starts[h]):int(starts[h + 1])] for h in range(self.num_hosts)]
        return _Streams(rec, src, tokens, card=(call_card.COMBINE, prep.H, prep.K, plan.seq))

    def _combine_in_host(self, prep: SimpleNamespace):
        """The intranode combine of a combine's rows (``prep`` from :meth:`_prepare_combine`) back to the rows
        this rank forwarded (per row: the fp32 sum over the host's ranks, rounded to bf16; padded to 4 bytes).
        Returns their record layout (the partial sum, then the weights' sums), the records' sources and the
        forwarded rows' indices (int64 ``[F]``, on the device); no host synchronisation."""
        plan, H, K = prep.plan, prep.H, prep.K
        inv = torch.empty_like(plan.order)
        inv.scatter_(0, plan.order, torch.arange(plan.num_rows, dtype=torch.int64, device=plan.order.device))
        x_int = prep.xv[inv]
        w_int = prep.wv[inv] if K else None
        prep.local_started = True
        comb, comb_w, _ = self._local_run(self.local.combine_steps(x_int, plan.local_handle, w_int))
        if H % 2:
            comb = torch.nn.functional.pad(comb, (0, 1))
        rec = NetRecord(2 * comb.shape[1], 0, 0, K, 0)
        rows = torch.arange(comb.shape[0], dtype=torch.int64, device=comb.device)
        return rec, self._sources(rec, comb.shape[0], comb, w=comb_w if K else None), rows
