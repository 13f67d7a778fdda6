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

import dataclasses
from typing import List, Optional, Union

import torch

from ... import kernels
from ... import scheduler as sched_mod
from ...config import EventOverlap
from ...errors import EPError, EPRemoteError, EPTimeoutError
from ...kernels import net
from ...kernels.params import check_num_sms
from ...protocol import call_card
from ...protocol.records import NetRecord
from ...runtime.checks import check_event
from ..intranode import Intranode
from ..intranode_args import DispatchArgs, Rows, cached_card_values, check_cached_dispatch, check_x, dispatch_args
from .capture import CapturePath
from .combine import combine_args, reduce_in_host, sum_over_hosts
from .exchange import HostExchange
from .forward import dispatch_results, forward_cached, forward_fresh
from .handle import CapturePlan, HostPlan, InternodeHandle, build_handle
from .host_ranks import HostRanks
from .network import agree_set_up, open_network, traffic_stats
from . import peer_tokens
from .rings import Rings
from .records import Forwarded, Streams, split_records

Tensor = torch.Tensor


@dataclasses.dataclass
class Fresh:
    """A dispatch without a handle, its arguments checked (both paths start so)."""
    rows: Rows                      # x [T, H] (and scales [T, S]), checked, contiguous
    args: DispatchArgs              # intranode's checks against the whole group (R = every rank of every host)
    card: tuple                     # this rank's call as its peers compare it (protocol.call_card)
    rec: NetRecord                  # its records' layout (ids, weights and is_token_in_rank bytes included)


@dataclasses.dataclass
class Cached:
    """A cached dispatch, its arguments checked (both paths start so)."""
    rows: Rows                      # x [T, H] (and scales [T, S]), checked, contiguous
    plan: Union[HostPlan, CapturePlan]      # its handle's plan
    card: tuple                     # this rank's call as its peers compare it (protocol.call_card)
    rec: NetRecord                  # its records' layout (no ids, weights or is_token_in_rank bytes)
    src: net.Sources                # the network-leg kernels' view of its rows


@dataclasses.dataclass
class HostDispatch:
    """A host-path dispatch between its steps."""
    rows: Rows                      # x [T, H] (and scales [T, S])
    src: net.Sources                # the network-leg kernels' view of its rows (and ids, weights, is_token_in_rank)
    streams: Streams                # its records for each host, as the headers tell them
    plan: Optional[HostPlan] = None         # a cached dispatch: its handle's plan
    fresh: Optional[Fresh] = None           # a fresh one: its checked arguments
    in_rank: Optional[Tensor] = None        # bool [T, R] is_token_in_rank (fresh)
    local_started: bool = False     # this rank entered its host's forwarding leg


class Internode:
    """Internode normal mode for one Buffer whose ranks span several hosts.

    Args:
        rt: the Buffer's :class:`~triton_ep.runtime.across_hosts.HostsRuntime` (``rt.hosts``: the hosts;
            ``rt.rdma_transport``: ``"verbs"`` or ``"emulated"``; ``rt.group``: the process group; ``rt.local``:
            this host's runtime, whose shared buffers carry the forwarding leg).
        intranode: the Buffer's group-wide :class:`Intranode` over ``rt`` (its layout kernel and routing).
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

    def __init__(self, rt, intranode: Intranode, num_qps_per_peer: Optional[int] = None,
                 slots: Optional[int] = None, slot_bytes: Optional[int] = None,
                 low_latency: tuple = (False, 0)) -> None:
        self.rt, self.intranode = rt, intranode
        self.hosts = hosts = rt.hosts
        if rt.group is None:
            raise NotImplementedError("internode mode needs a torch.distributed process group (ranks simulated "
                                      "in one process cannot span hosts)")
        me = rt.rank
        self.host, self.local_index = hosts.host_of[me], hosts.local_index(me)
        self.num_hosts, self.per_host = hosts.num_hosts, hosts.ranks_per_host
        #: the other hosts: each holds one RDMA peer of this rank
        self.peer_hosts = [h for h in range(self.num_hosts) if h != self.host]
        self.host_ranks: Optional[HostRanks] = None
        #: seconds close() waited for the RDMA peers to close too (:meth:`close`)
        self.close_waited_s = 0.0
        self.sched = self.transport = self._ring_mem = None
        #: int32 [num_hosts, per_host]: the global rank (is_token_in_rank column) of each host's local ranks
        self._cols = torch.tensor([list(hosts.ranks(h)) for h in range(self.num_hosts)], dtype=torch.int32,
                                  device=rt.device)
        #: the same, flat (``hosts.rank_order``): the columns of is_token_in_rank host by host; None: in order
        self._order = None if hosts.rank_order == tuple(range(rt.group_size)) else self._cols.view(-1)
        #: this Buffer's internode calls so far (equal on ranks in step, whether the calls succeeded or not):
        #: names a dispatch's handle (its plan's ``seq``) and stamps the disagreements posted in the call cards
        #: (:meth:`HostRanks.skip`)
        self._calls = 0
        #: seconds this rank's calls spent in the network leg (packing, waiting, unpacking), and its exchanges
        self.network_s, self.exchanges = 0.0, 0
        #: exchanges through host memory (headers, statuses, counts): the host path's; the capture path makes none
        self.host_exchanges = 0
        self.peers, self.rings = HostExchange(self), Rings(self)
        try:
            # this host's ranks share their own buffers (the forwarding leg); nothing is mapped between hosts
            self.local_group, self.peer_group = rt.local_group, rt.peer_group
            self.host_ranks = HostRanks(rt.local, hosts, self.host, self.local_index, lambda: self._calls)
            self.local = self.host_ranks.local
            agreed = agree_set_up(rt, self.num_hosts, (num_qps_per_peer, slots, slot_bytes), low_latency)
            #: the emulated fabric's (reorder_s, skew_s) the ranks agreed on (None: verbs); the low-latency
            #: network leg takes them too (:class:`~triton_ep.modes.internode.low_latency.LowLatencyAcrossHosts`)
            self.delays = agreed.delays
            #: where the RDMA proxies run (``TRITON_EP_PROXY``), as every rank of the group agreed
            self.proxy = agreed.proxy
            #: the capture path (:class:`~triton_ep.modes.internode.capture.CapturePath`): its calls and state
            self.capture = CapturePath(self, agreed.capture)
            self.capture.open_store(rt.group, agreed.token)
            self._open_rings(agreed.token, *agreed.shape)
        except BaseException:
            self.close()
            raise

    def _open_rings(self, token: str, num_qps_per_peer: int, slots: int, slot_bytes: int) -> None:
        """Open the network leg to the RDMA peers: the rings, host memory the proxy and the NIC see, pinned and
        device-mapped for GPU kernels."""
        rt = self.rt
        names = [f"ep{token}_{r}" for r in range(rt.group_size)]
        leg = open_network(rt.rdma_transport, self.peer_group, self.host, self.num_hosts, token=token, names=names,
                           name=names[rt.rank], num_qps_per_peer=num_qps_per_peer, slots=slots, slot_bytes=slot_bytes,
                           timeout_s=rt.timeout_s, device=rt.device, proxy=self.proxy,
                           delays=self.delays)
        self.transport, self.sched, self._ring_mem = leg.transport, leg.sched, leg.mem
        self._ring_ctrl, self._ring_send, self._ring_recv = leg.ring_ctl, leg.send, leg.recv

    def close(self) -> None:
        """Meet the RDMA peers as they close too (bounded: :meth:`~.peer_tokens.PeerTokens.meet_at_close`; the
        seconds it took in :attr:`close_waited_s`), then stop the proxy, release the QPs, MRs, CQs and PD, and the
        host's shared buffers. Idempotent."""
        sched, transport, host_ranks = self.sched, self.transport, self.host_ranks
        if sched is not None and getattr(self, "capture", None) is not None:
            self.close_waited_s = self.capture.peer_tokens.meet_at_close(
                min(self.rt.timeout_s, peer_tokens.CLOSE_MEET_S), lambda: sched.error is not None)
            self.capture.close()
        self.sched = self.transport = None
        self.local_group = self.peer_group = None       # the HostsRuntime destroys them
        # (before the scheduler closes: with the proxy in a process of its own it unmaps the rings then, which it
        # does only where no view of them is left)
        self._ring_mem = self._ring_ctrl = self._ring_send = self._ring_recv = None
        try:
            if sched is not None:
                sched.close()
        finally:
            try:
                if transport is not None:
                    transport.close()
            finally:
                if host_ranks is not None:
                    host_ranks.close()

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
                             self.host_exchanges, self.capture.staging_bytes)

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
            self.host_ranks.annotate(ex)
            comm = self.host_ranks.local_rt.comm
            if comm is not None and comm.broken and self.sched.error is None:
                # the network's twin of HostRanks.leave: the RDMA peers hear it from the fault word and raise at once
                self.sched.fail(self.host_ranks.rooted(EPRemoteError(
                    f"rank {self.rt.rank}: the forwarding leg of host {self.host} failed for good ({comm.broken})")))
            raise
        try:
            self.sched.check()
            self.rings.ring_error()          # a ring kernel's wait that failed (the capture path's came unseen)
        except (sched_mod.ProxyError, EPTimeoutError) as ex:
            self.host_ranks.leave()
            raise self.rings.global_error(ex) from ex

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
        per_host = self.host_mask(is_token_in_rank)
        return per_host.sum(dim=0, dtype=torch.int32)

    def host_mask(self, is_token_in_rank: Tensor) -> Tensor:
        """bool ``[T, num_hosts]``: token ``t`` goes to at least one rank of host ``h``."""
        in_rank = is_token_in_rank if self._order is None else is_token_in_rank.index_select(1, self._order)
        return in_rank.view(in_rank.shape[0], self.num_hosts, self.per_host).any(dim=2)

    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``Buffer.get_dispatch_layout`` across hosts: the layout of the Buffer's group-wide :class:`Intranode` (the
        same kernel), plus ``num_tokens_per_rdma_rank`` int32 ``[num_hosts]`` second. Raises at once where an earlier
        call failed for good (:meth:`_live`)."""
        self._live()
        return self.intranode.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
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


    def row_sources(self, rec: NetRecord, n: int, x: Tensor, sc: Optional[Tensor] = None, ids: Optional[Tensor] = None,
                    w: Optional[Tensor] = None, in_rank: Optional[Tensor] = None) -> net.Sources:
        """:meth:`net.Sources.of_rows` of this rank's ``n`` rows (its device, its host columns)."""
        return net.Sources.of_rows(rec, n, x, self._cols, self.rt.rank, self.rt.device, sc, ids, w, in_rank)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False,
                 operation=call_card.DISPATCH):
        """``Buffer.dispatch`` across hosts (same arguments and results; the handle is an :class:`InternodeHandle`;
        the kernels run on the caller's stream; ``operation``: the call as its card names it,
        :attr:`~triton_ep.modes.intranode_args.DispatchArgs.operation`). The capture path takes the calls
        :meth:`CapturePath.takes` picks.

        Raises:
            ValueError / TypeError: bad arguments (``num_tokens_per_rdma_rank`` other than the tokens sent to
            each host included), before anything moves; EPTimeoutError / ProxyError: a peer or the RDMA proxy
            did not answer within ``timeout_s``.
        """
        self._calls += 1
        self._live()
        if self.capture.takes(num_worst_tokens, handle):
            return self.capture.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                         num_worst_tokens, previous_event)
        prep = err = None
        try:
            check_num_sms(config, "internode")
            if handle is not None:
                prep = self._cached_dispatch(self.cached_args(x, handle, topk_idx, topk_weights, previous_event))
            else:
                prep = self._host_dispatch(self.fresh(x, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                                      is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                                      expert_alignment, num_worst_tokens, previous_event, operation),
                                           num_tokens_per_rdma_rank)
        except Exception as e:   # noqa: BLE001 - the RDMA peers and this host's ranks are told, then it is raised
            err = e
        kind = "dispatch" if handle is None else "cached"
        fwd, counts, npe_f = self.rings.exchange(prep.streams if prep else None, prep.src if prep else None, err,
                                                 skip=kind)
        result = err = None
        try:
            sc = prep.rows.scales
            records = split_records(fwd, prep.streams.rec, None if sc is None else sc.dtype,
                                    self.host_ranks.local_rt.device)
            del fwd         # (its fields were copied out: the records go before the forwarding leg's outputs come)
            result = self._forward(prep, records, counts, npe_f, expert_alignment, num_worst_tokens)
        except Exception as e:   # noqa: BLE001 - the RDMA peers hear of it (their hosts' ranks then fail alike)
            err = e
            if not prep.local_started:      # this host's ranks wait for this rank's part of the leg
                self.host_ranks.skip(kind, e)
        self.peers.status(err)
        return result

    def fresh(self, x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
              topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event,
              operation: int = call_card.DISPATCH) -> Fresh:
        """Check a dispatch's arguments (both paths): ``num_tokens_per_rdma_rank`` present, then intranode
        mode's group-wide checks (R = every rank of every host); its call card (``operation``: as :meth:`dispatch`'s)
        and record layout."""
        self.check_tokens_per_host(num_tokens_per_rdma_rank, required=True)
        rows, a = dispatch_args(self.rt, x, None, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event, operation)
        code, values = a.card(num_worst_tokens)
        K = a.num_topk
        rec = NetRecord(rows.row_bytes, rows.scale_bytes, K, 0 if a.topk_weights is None else K, self.per_host)
        return Fresh(rows, a, (code, *values), rec)

    def _host_dispatch(self, f: Fresh, num_tokens_per_rdma_rank: Tensor) -> HostDispatch:
        """A fresh dispatch on the host path: its routing checked on the host (ids in range, non-negative
        counts, ``num_tokens_per_rdma_rank`` as the routing gives it), and its records for each host."""
        a, E = f.args, f.args.num_experts
        idx = a.topk_idx
        if idx is not None:
            bad = idx[(idx < -1) | (idx >= E)]
            if bad.numel():
                raise ValueError(f"rank {self.rt.rank}: topk_idx holds ids outside [-1, {E}): {bad[:8].tolist()}")
        elif (a.num_tokens_per_expert < 0).any():   # routed by is_token_in_rank, counted by the given counts
            raise ValueError(f"rank {self.rt.rank}: num_tokens_per_expert holds negative counts (without "
                             f"topk_idx the given counts are used as they are)")
        if idx is not None:     # (the layout kernel; its bad-id count is 0: checked above)
            _, _, in_rank, _, _, _ = kernels.routing_layout(idx, E, self.rt.group_size)
        else:
            in_rank = a.is_token_in_rank
        host_mask = self.host_mask(in_rank)
        want = host_mask.sum(dim=0, dtype=torch.int32)
        if not torch.equal(num_tokens_per_rdma_rank.to(want.device), want):
            raise ValueError(f"rank {self.rt.rank}: num_tokens_per_rdma_rank {num_tokens_per_rdma_rank.tolist()} "
                             f"differs from the tokens this rank sends to each host {want.tolist()} (by "
                             f"{'topk_idx' if idx is not None else 'is_token_in_rank'}); pass what "
                             f"get_dispatch_layout returned")
        to_host = [torch.nonzero(host_mask[:, h], as_tuple=True)[0] for h in range(self.num_hosts)]
        src = self.row_sources(f.rec, a.num_tokens, f.rows.x, f.rows.scales, None if idx is None else idx.long(),
                               a.topk_weights, in_rank)
        streams = Streams(f.rec, to_host, None if idx is not None else a.num_tokens_per_expert, card=f.card)
        return HostDispatch(f.rows, src, streams, fresh=f, in_rank=in_rank)

    def _cached_dispatch(self, c: "Cached") -> HostDispatch:
        """A cached dispatch on the host path: its records for each host."""
        return HostDispatch(c.rows, c.src, Streams(c.rec, c.plan.to_host, card=c.card), plan=c.plan)

    def cached_args(self, x, handle, topk_idx, topk_weights, previous_event) -> "Cached":
        """Check a cached dispatch's arguments (both paths): its rows, its handle's plan, its call card, its record
        layout and the records' sources."""
        check_event(previous_event)
        rows = check_x(self.rt, x)
        plan = self.check_handle(handle)
        check_cached_dispatch(rows.x.shape[0], plan.num_tokens, topk_idx, topk_weights)
        rec = NetRecord(rows.row_bytes, rows.scale_bytes, 0, 0, 0)
        card = (call_card.CACHED_DISPATCH, *cached_card_values(rows, plan.seq))
        return Cached(rows, plan, card, rec, self.row_sources(rec, rows.x.shape[0], rows.x, rows.scales))

    def _forward(self, prep: HostDispatch, records: Forwarded, counts: List[int], npe_f: Optional[Tensor],
                 expert_alignment: int, num_worst_tokens: int) -> tuple:
        """The forwarding leg (the intranode dispatch of ``records``, those this rank received over the network
        and its own for its host, ``F`` of them, split into their fields; released once it took them) and the
        results in DeepEP's order. ``npe_f``: without ``topk_idx``, the per-expert counts of the forwarded rows
        (from the sources)."""
        rows = prep.rows
        if prep.plan is not None:              # cached: the same routes, new rows
            prep.local_started = True
            return forward_cached(self, records, prep.plan, rows.x.dtype, rows.x.shape[1])

        def started():
            prep.local_started = True
        got = forward_fresh(self, records, prep.fresh.args, rows.x.dtype, npe_f, None, expert_alignment, num_worst_tokens,
                            started)
        to_host, T = prep.streams.tokens, rows.x.shape[0]
        if self.capture.mode:      # its cached dispatches and combines: no host wait, no host exchange
            plan = CapturePlan.of_plain(self.rt.uid, self._calls, T, to_host, counts, got.local_handle, got.order)
        else:
            plan = HostPlan(self.rt.uid, self._calls, T, to_host, counts, got.local_handle, got.order,
                            got.order.shape[0])
        head = torch.full((T, self.num_hosts), -1, dtype=torch.int32, device="cpu")
        for h in range(self.num_hosts):
            head[to_host[h].cpu(), h] = torch.arange(to_host[h].numel(), dtype=torch.int32, device="cpu")
        sent = torch.tensor([t.numel() for t in to_host], dtype=torch.int32, device="cpu")
        recv = torch.tensor(counts, dtype=torch.int32, device="cpu")
        return dispatch_results(got, build_handle(prep.in_rank, sent, recv, got, head.to(rows.x.device), plan))

    def check_handle(self, handle) -> Union[HostPlan, CapturePlan]:
        """The plan of ``handle``, an internode dispatch's of this Buffer (both paths).

        Raises:
            TypeError: no :class:`InternodeHandle` (another mode's handle, a tuple with an entry of another type,
            named, or rebuilt from a handle's entries). ValueError: a tuple of another number of entries, or a
            handle of another Buffer (``Runtime.check_handle``).
        """
        return self.rt.check_handle(handle, InternodeHandle, "dispatch").plan

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
            check_num_sms(config, "internode")
            prep = combine_args(self, x, handle, topk_weights, bias, previous_event)
        except Exception as e:   # noqa: BLE001 - this host's ranks and the RDMA peers are told, then it is raised
            err = e
            self.host_ranks.skip("combine")
        streams = src = None
        if err is None:
            try:
                streams, src = reduce_in_host(self, prep)
            except Exception as e:   # noqa: BLE001 - the RDMA peers hear of it (this host's ranks failed alike)
                err = e
                if not prep.local_started:      # this host's ranks wait for this rank's part of the leg
                    self.host_ranks.skip("combine", e)
        got, counts, _ = self.rings.exchange(streams, src, err)
        del src         # (this host's sums, sent: they go before the sums over hosts are made)
        return sum_over_hosts(self, prep, streams.rec, got, counts)

    def internode_dispatch(self, *args, **kwargs):
        """``Buffer.internode_dispatch``: :meth:`dispatch`."""
        return self.dispatch(*args, **kwargs)

    def internode_combine(self, *args, **kwargs):
        """``Buffer.internode_combine``: :meth:`combine`."""
        return self.combine(*args, **kwargs)
