"""Normal mode across hosts (DeepEP's internode normal mode): two-level dispatch and combine.

**Two levels, as DeepEP.** Rank ``s`` (host ``h``, local index ``l``) sends each token once to every other
host that holds one of its experts, to the rank with the same local index there (its *RDMA peer*), through
the RDMA scheduler (:mod:`triton_ep.scheduler`); that rank forwards it, with the intranode dispatch over
IPC, to the ranks of its host that need it. Combine runs backwards: rows are summed inside the destination
host first (the intranode combine: fp32 in ascending local rank order, rounded once to bf16), cross the
network once as bf16 partial sums, and are summed on the source rank in ascending host order in fp32 (plus
the biases) and rounded once more to bf16. :func:`triton_ep.reference.combine` with ``ranks_per_host``
models that order exactly.

**This version is host-driven**: the network leg is packed, posted and unpacked by the host
(:func:`triton_ep.scheduler.host_alltoall`; the proxy threads post the chunks' WRITEs and signals over the
QP plan), so a call waits on the host and cannot be captured in a CUDA graph. Its results are what the
device-driven path (kernels that pack the rings) must reproduce.

Records on the network leg (uint8 rows, 16-byte aligned): ``[meta (4 int32: global source rank, source
token, 0, 0) | x row | scales | top-k ids (int64) | top-k weights (fp32) | is_token_in_rank of the
destination host's ranks (1 byte each)]`` (:class:`_Record`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from types import SimpleNamespace
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import scheduler as sched_mod
from ..config import EventOverlap
from ..errors import EPCapacityError, EPError, EPRemoteError, EPTimeoutError
from ..runtime import Runtime
from ..runtime.checks import check_event
from ..runtime.context import open_runtime
from ..transport import factory
from ..transport.bootstrap import gather_objects
from .. import kernels
from .intranode import DispatchHandle, Intranode, check_cached_dispatch

Tensor = torch.Tensor
_META = 16                  # bytes of a record's meta block
#: the network leg's defaults: RC QPs per RDMA peer, ring slots per peer, bytes per slot (chunk)
DEFAULT_QPS_PER_PEER, DEFAULT_SLOTS, DEFAULT_SLOT_BYTES = 4, 8, 1 << 16


def _up16(n: int) -> int:
    return (n + 15) // 16 * 16


def _field(rows: Tensor, lo: int, hi: int, dtype: torch.dtype) -> Tensor:
    """Bytes ``[lo, hi)`` of each of ``rows`` (uint8 ``[n, nbytes]``) as ``dtype`` ``[n, (hi - lo) / size]``, in
    fresh memory (a slice of one row keeps its offset, which a wider dtype's view may not take)."""
    out = torch.empty((rows.shape[0], hi - lo), dtype=torch.uint8, device=rows.device)
    out.copy_(rows[:, lo:hi])
    return out.view(dtype)


_FIELDS = ("meta", "row", "scales", "ids", "weights", "local")


@dataclasses.dataclass(frozen=True)
class _Record:
    """Byte layout of one network-leg record (every rank alike: checked at each exchange): the fields of
    ``_FIELDS`` in that order, each field's offset computed here only (:meth:`span`)."""
    row: int            # bytes of an x row (a combine: the bf16 partial sum)
    scales: int         # bytes of a row's scales
    ids: int            # top-k ids (int64); 0 for a cached dispatch and a combine
    weights: int        # top-k weights (fp32): as many as the ids, or 0; a combine: their sums
    local: int          # ranks per host (is_token_in_rank bytes); 0 for a cached dispatch and a combine

    def _sizes(self) -> Tuple[int, ...]:
        return (_META, self.row, self.scales, 8 * self.ids, 4 * self.weights, self.local)

    @property
    def nbytes(self) -> int:
        return _up16(sum(self._sizes()))

    def span(self, field: str) -> Tuple[int, int]:
        """Bytes ``[lo, hi)`` of ``field`` (one of ``_FIELDS``) in a record."""
        i = _FIELDS.index(field)
        lo = sum(self._sizes()[:i])
        return lo, lo + self._sizes()[i]

    def key(self) -> Tuple[int, ...]:
        return (self.row, self.scales, self.ids, self.weights, self.local)

    def put(self, out: Tensor, field: str, value: Tensor) -> None:
        """Write ``value`` (``[n, ...]``, any dtype) as ``field`` of the records ``out`` (uint8 ``[n, nbytes]``)."""
        lo, hi = self.span(field)
        out[:, lo:hi] = value.contiguous().view(torch.uint8).view(out.shape[0], hi - lo)

    def get(self, rows: Tensor, field: str, dtype: torch.dtype) -> Tensor:
        """``field`` of the records ``rows`` (uint8 ``[n, nbytes]``) as ``dtype`` ``[n, ...]``, in fresh memory."""
        return _field(rows, *self.span(field), dtype)


def network_record_bytes(row_bytes: int, scale_bytes: int, num_topk: int, weights: bool, ranks_per_host: int) -> int:
    """Bytes of one network-leg dispatch record (16-byte aligned): meta, an x row of ``row_bytes``, its
    ``scale_bytes``, ``num_topk`` int64 ids (and fp32 weights with ``weights``), and ``ranks_per_host`` bytes of
    ``is_token_in_rank``. A combine record is ``network_record_bytes(2 * hidden + 4 * num_topk, 0, 0, False, 0)``
    (the partial sum in bf16, then the weights' fp32 sums)."""
    return _Record(row_bytes, scale_bytes, num_topk, num_topk if weights else 0, ranks_per_host).nbytes


def traffic_stats(transport: Optional[str] = None, num_hosts: int = 1, sched_stats: Optional[dict] = None,
                  network_s: float = 0.0, exchanges: int = 0) -> dict:
    """``Buffer.get_rdma_stats``'s dict from the scheduler's :meth:`~triton_ep.scheduler.Scheduler.stats`
    (channels summed from its QPs); the defaults give a Buffer on one host: no traffic."""
    s = sched_stats or {"qps": {}, "ports": {}, "wrs": 0}
    channels: dict = {}
    for q in s["qps"].values():
        c = channels.setdefault(q["channel"], {"bytes": 0, "chunks": 0})
        c["bytes"] += q["bytes"]
        c["chunks"] += q["chunks"]
    return {"transport": transport, "num_hosts": num_hosts, "qps": s["qps"], "ports": s["ports"],
            "channels": channels, "wrs": s["wrs"], "network_s": network_s, "exchanges": exchanges}


class InternodeHandle(tuple):
    """The handle of an internode dispatch: DeepEP's 10-tuple (what each entry holds below), with this
    mode's plan for cached dispatches and combine kept as attributes.

    0. ``is_token_in_rank`` bool ``[T, R]``;
    1. ``rdma_channel_prefix_matrix`` int32 ``[num_hosts, 1]``: tokens this rank sends to each host;
    2. ``gbl_channel_prefix_matrix`` int32 ``[R, 1]``: tokens this rank sends to each rank;
    3. ``recv_rdma_channel_prefix_matrix`` int32 ``[num_hosts, 1]``: tokens this rank forwards for each
       source host (its RDMA peers, and itself);
    4. ``recv_rdma_rank_prefix_sum`` int32 ``[num_hosts]``: cumulative of 3;
    5. ``recv_gbl_channel_prefix_matrix`` int32 ``[R, 1]``: rows this rank receives from each rank;
    6. ``recv_gbl_rank_prefix_sum`` int32 ``[R]``: rows received from ranks ``0..i`` (DeepEP's meaning);
    7. ``recv_src_meta`` int32 ``[N, 2]``: each received row's global source rank and source token (``-1`` on
       padding rows);
    8. ``send_rdma_head`` int32 ``[T, num_hosts]``: token ``t``'s index among the rows sent to each host (``-1``);
    9. ``send_nvl_head`` int32 ``[F, ranks per host]``: the intranode ``send_head`` of the rows this rank
       forwarded (``F`` of them).
    """

    def __new__(cls, items, plan):
        h = super().__new__(cls, items)
        h.plan = plan
        return h


@dataclasses.dataclass
class _Plan:
    uid: str
    seq: int
    num_tokens: int
    to_host: List[Tensor]           # per host: int64 indices of this rank's tokens sent there, ascending
    from_host: List[int]            # per host: rows this rank forwards for it
    local_handle: DispatchHandle    # the intranode dispatch of the forwarded rows
    order: Tensor                   # int64 [N]: received row i is intranode row order[i]
    num_rows: int                   # N (padding included)


class Internode:
    """Internode normal mode for one Buffer whose ranks span several hosts.

    Args:
        rt: the Buffer's runtime (``rt.hosts``: the hosts; ``rt.rdma_transport``: ``"verbs"`` or
            ``"emulated"``; ``rt.group``: the process group).
        num_nvl_bytes: bytes of the intranode buffer the ranks of each host share (the forwarding leg).
        num_qps_per_peer: RC QPs to each RDMA peer (placed over ports and ECMP paths).
        slots, slot_bytes: the scheduler's rings: chunks in flight per peer and bytes per chunk.

    Raises:
        NotImplementedError: ranks simulated in one process (internode mode needs a process group).
        EPTimeoutError / EPRemoteError: a rank did not take part in the set-up within ``rt.timeout_s``.
    """

    def __init__(self, rt: Runtime, num_nvl_bytes: int, num_qps_per_peer: int = DEFAULT_QPS_PER_PEER,
                 slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
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
        order = hosts.rank_order
        self._order = None if order == tuple(range(rt.group_size)) else torch.tensor(order, device=rt.device)
        self.local_rt: Optional[Runtime] = None
        self.sched = self.transport = None
        self._seq = 0
        #: seconds this rank's calls spent in the network leg (packing, waiting, unpacking), and its exchanges
        self.network_s, self.exchanges = 0.0, 0
        try:
            # every rank makes every subgroup, in the same order (torch.distributed's rule)
            local_groups = [dist.new_group(list(hosts.ranks(h))) for h in range(self.num_hosts)]
            peer_groups = [dist.new_group([hosts.ranks(h)[i] for h in range(self.num_hosts)])
                           for i in range(self.per_host)]
            self.local_group, self.peer_group = local_groups[self.host], peer_groups[self.local_index]
            self.local_rt = open_runtime(self.local_group, num_nvl_bytes, 0, False, rt.timeout_s, rt.device)
            self.local_rt.agree_on_layout()
            self.local = Intranode(self.local_rt)
            token = gather_objects(rt.group, uuid.uuid4().hex[:12], rt.timeout_s, "internode: fabric token")[0]
            names = [f"ep{token}_{r}" for r in range(rt.group_size)]
            kw = dict(num_qps_per_peer=num_qps_per_peer, timeout_s=rt.timeout_s)
            fabric = None
            if rt.rdma_transport == "emulated":
                fabric = factory.emulated_fabric(names, token)
                kw.update(fabric=fabric, device_name=names[me])
            elif rt.device.type == "cuda":
                kw["gpu"] = rt.device.index
            self.transport = factory.open_transport(rt.rdma_transport, self.host, self.num_hosts, **kw)
            self.sched = sched_mod.bootstrap(self.transport, dict(slots=slots, slot_bytes=slot_bytes,
                                                                  timeout_s=rt.timeout_s), group=self.peer_group)
            if fabric is not None:      # every peer has mapped this rank's rings: a killed process leaves none
                fabric.unlink_rings()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the proxy, release the QPs, MRs, CQs and PD, and the host's shared buffers. Idempotent."""
        sched, transport, local_rt = self.sched, self.transport, self.local_rt
        self.sched = self.transport = self.local_rt = None
        try:
            if sched is not None:
                sched.close()
        finally:
            try:
                if transport is not None:
                    transport.close()
            finally:
                if local_rt is not None:
                    local_rt.close()

    def stats(self) -> dict:
        """Traffic since construction: the scheduler's bytes, work requests and chunks per QP (``"host/qp"``
        keys, with channel and port), bytes per port and per channel, and the network leg's seconds."""
        return traffic_stats(self.rt.rdma_transport, self.num_hosts,
                             self.sched.stats() if self.sched is not None else None, self.network_s, self.exchanges)

    # ------------------------------------------------------------------ layout
    def _live(self) -> None:
        """Raise at once where an earlier call failed: the Buffer destroyed (``EPError``), a kernel's
        recorded error, or the RDMA proxy's (sticky: every later call raises it, with global ranks)."""
        self.rt.live()
        self.rt.check()
        if self.sched is None:
            raise EPError(f"rank {self.rt.rank}: this Buffer was destroyed")
        try:
            self.sched.check()
        except (sched_mod.ProxyError, EPTimeoutError) as ex:
            raise self._global(ex) from ex

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
        normal mode: the same kernel), plus ``num_tokens_per_rdma_rank`` int32 ``[num_hosts]`` second."""
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
    def _exchange(self, sends: Optional[List[Optional[Tensor]]], rec: Optional[_Record],
                  err: Optional[BaseException] = None, tell: bool = True) -> Tuple[List[Optional[Tensor]], List[int]]:
        """Send ``sends[h]`` (uint8 ``[n_h, rec.nbytes]``; ``None`` for this rank's own host) to the RDMA
        peer on each host and receive theirs: first a header (a status, the row count and the record layout,
        which must agree), then the rows. A rank that failed (``err``) sends only its header. Where this rank
        or a peer failed, every rank of the exchange raises after the headers, and (with ``tell``: the
        exchange comes before the forwarding leg) this rank first tells its own host's ranks (their
        forwarding-leg waits end; they tell their own RDMA peers in turn).

        Returns: per host the received rows (``None`` for this host) and the counts.
        Raises: ``err``; ``EPRemoteError`` / ``EPCapacityError`` naming the peer that failed; ``ValueError``
        when the layouts differ (the ranks called with different arguments); the proxy's errors.
        """
        try:
            with self._network():
                return self._exchange_rows(sends, rec, err)
        except BaseException:
            if tell:
                self._tell_host()
            raise

    @contextlib.contextmanager
    def _network(self):
        """One exchange with the RDMA peers: counted and timed (:meth:`stats`), the scheduler's errors given
        global ranks and hosts."""
        t0 = time.perf_counter()
        try:
            yield
        except (sched_mod.ProxyError, EPTimeoutError) as ex:
            raise self._global(ex) from ex
        finally:
            self.network_s += time.perf_counter() - t0
            self.exchanges += 1

    def _local_run(self, gen):
        """Run an intranode call of this host's ranks; its errors number the host's ranks from 0, so they
        are told which global ranks those are."""
        try:
            return self.local_rt.run(gen)
        except EPError as ex:
            ranks = list(self.hosts.ranks(self.host))
            if ex.args and isinstance(ex.args[0], str):
                ex.args = (f"{ex.args[0]} [internode: in the forwarding leg of host {self.host}, ranks are numbered "
                           f"within the host: 0..{len(ranks) - 1} are global ranks {ranks}; this is global rank "
                           f"{self.rt.rank}]",) + ex.args[1:]
            raise

    def _tell_host(self) -> None:
        """This rank leaves the running call before its forwarding leg: the ranks of its host that wait for
        it there stop at once (a failure word, as an intranode call that fails) and raise ``EPRemoteError``."""
        if self.local_rt is not None and self.local_rt.comm is not None:
            self.local_rt.wait_comm_stream()
            self.local_rt.sig.post_local_failure()

    def _status(self, err: Optional[BaseException]) -> None:
        """After the forwarding leg: tell the RDMA peers whether this rank's part succeeded and hear theirs
        (every rank of a host fails such a leg alike, so each rank hears of a host that failed from its own
        peer there). Raises ``err``, else the first peer's failure."""
        with self._network():
            self._headers(None, None, err)

    def _headers(self, sends, rec: Optional[_Record], err: Optional[BaseException] = None) -> List[int]:
        """The header exchange of :meth:`_exchange` (``sends`` ``None``: a status alone). Returns the counts."""
        peers = self.peer_hosts
        key = rec.key() if rec is not None else (0,) * 5
        code = 0 if err is None else (2 if isinstance(err, EPCapacityError) else 1)
        head = {h: np.array([code, 0 if sends is None or err is not None else sends[h].shape[0], *key],
                            np.int64).view(np.uint8) for h in peers}
        got = sched_mod.host_alltoall(self.sched, head, {h: 56 for h in peers})
        words = {h: got[h].view(np.int64) for h in peers}
        if err is not None:
            raise err
        for h in peers:
            if words[h][0]:
                who = f"rank {self._peer_rank(h)} (host {h})"
                if words[h][0] == 2:
                    raise EPCapacityError(f"rank {self.rt.rank}: {who} found more rows than num_worst_tokens on its "
                                          f"host; no rank returns from this dispatch")
                raise EPRemoteError(f"rank {self.rt.rank}: {who} failed this call (its own error names why); "
                                    f"this rank stopped too")
        for h in peers:
            if rec is not None and tuple(int(w) for w in words[h][2:]) != key:
                raise ValueError(
                    f"rank {self.rt.rank}: rank {self._peer_rank(h)} on host {h} sends records of another layout "
                    f"(row bytes, scale bytes, top-k, weights, ranks per host: "
                    f"{tuple(int(w) for w in words[h][2:])} there, {key} here): the ranks called with different "
                    f"arguments")
        counts = [0] * self.num_hosts
        for h in peers:
            counts[h] = int(words[h][1])
        return counts

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

    def _exchange_rows(self, sends, rec: Optional[_Record], err: Optional[BaseException]):
        peers = self.peer_hosts
        counts = self._headers(sends, rec, err)
        data = {h: sends[h].reshape(-1).numpy() for h in peers}
        got = sched_mod.host_alltoall(self.sched, data, {h: counts[h] * rec.nbytes for h in peers})
        out: List[Optional[Tensor]] = [None] * self.num_hosts
        for h in peers:
            out[h] = torch.from_numpy(got[h]).view(counts[h], rec.nbytes)
        return out, counts

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, intranode: Intranode, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """``Buffer.dispatch`` across hosts (same arguments and results; the handle is an
        :class:`InternodeHandle`). ``intranode``: the Buffer's group-wide normal mode (its checks of ``x``).

        Raises:
            ValueError / TypeError: bad arguments, before anything moves; NotImplementedError: no
            ``topk_idx`` (this version routes by it); EPTimeoutError / ProxyError: a peer or the RDMA proxy
            did not answer within ``timeout_s``.
        """
        self._live()
        prep = err = None
        try:
            prep = self._prepare_dispatch(intranode, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                          expert_alignment, num_worst_tokens, previous_event)
        except Exception as e:   # noqa: BLE001 - the RDMA peers and this host's ranks are told, then it is raised
            err = e
        got, counts = self._exchange(prep.sends if prep else None, prep.rec if prep else None, err)
        result = err = None
        try:
            result = self._forward(prep, got, counts, expert_alignment, num_worst_tokens)
        except Exception as e:   # noqa: BLE001 - the RDMA peers hear of it (their hosts' ranks then fail alike)
            err = e
            if not prep.local_started:      # this host's ranks wait for this rank's part of the leg
                self._tell_host()
        self._status(err)
        return result

    def _prepare_dispatch(self, intranode, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                          num_worst_tokens, previous_event) -> SimpleNamespace:
        """Check a dispatch's arguments and pack its records for each host (nothing moves yet)."""
        if handle is not None:
            check_event(previous_event)
            xv, sc = intranode.check_x(x)
            plan = self._check_handle(handle)
            check_cached_dispatch(xv.shape[0], plan.num_tokens, topk_idx, topk_weights)
            rec = _Record(xv.shape[1] * xv.element_size(), 0 if sc is None else sc.shape[1] * 4, 0, 0, 0)
            records = [self._records(xv, sc, None, None, None, plan.to_host[h], h, rec)
                       for h in range(self.num_hosts)]
            return SimpleNamespace(xv=xv, sc=sc, rec=rec, records=records, sends=self._sends(records), plan=plan,
                                   local_started=False)
        self.check_tokens_per_host(num_tokens_per_rdma_rank, required=True)
        if topk_idx is None:
            raise NotImplementedError("dispatch across hosts routes by topk_idx in this version: pass topk_idx")
        # the group-wide checks of intranode mode (R = every rank of every host)
        a = intranode.dispatch_args(x, None, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                    topk_weights, expert_alignment, num_worst_tokens, previous_event)
        xv, sc, idx, w, E, K = a.x, a.scales, a.topk_idx, a.topk_weights, a.num_experts, a.num_topk
        bad = idx[(idx < -1) | (idx >= E)]
        if bad.numel():
            raise ValueError(f"rank {self.rt.rank}: topk_idx holds ids outside [-1, {E}): {bad[:8].tolist()}")
        in_rank = kernels.routing_layout(idx, E, self.rt.group_size)[2]
        host_mask = self._host_mask(in_rank)
        to_host = [torch.nonzero(host_mask[:, h], as_tuple=True)[0] for h in range(self.num_hosts)]
        rec = _Record(xv.shape[1] * xv.element_size(), 0 if sc is None else sc.shape[1] * 4, K,
                      0 if w is None else K, self.per_host)
        records = [self._records(xv, sc, idx, w, in_rank, to_host[h], h, rec) for h in range(self.num_hosts)]
        return SimpleNamespace(xv=xv, sc=sc, rec=rec, records=records, sends=self._sends(records), plan=None,
                               idx=idx, E=E, in_rank=in_rank, to_host=to_host, local_started=False)

    def _sends(self, records: List[Tensor]) -> List[Optional[Tensor]]:
        return [None if h == self.host else records[h] for h in range(self.num_hosts)]

    def _forward(self, prep: SimpleNamespace, got: List[Optional[Tensor]], counts: List[int], expert_alignment: int,
                 num_worst_tokens: int) -> tuple:
        """The forwarding leg (the intranode dispatch of the rows this rank received over the network and of
        its own rows for its host) and the results in DeepEP's order."""
        xv, sc, rec = prep.xv, prep.sc, prep.rec
        got[self.host] = prep.records[self.host]
        counts[self.host] = prep.records[self.host].shape[0]
        fwd = torch.cat(got, 0)
        x_f, sc_f, ids_f, w_f, in_f = self._split(fwd, rec, xv.dtype, None if sc is None else sc.dtype)
        xs_f = x_f if sc_f is None else (x_f, sc_f)
        if prep.plan is not None:              # cached: the same routes, new rows
            prep.local_started = True
            plan = prep.plan
            recv = self._local_run(self.local.dispatch_steps(xs_f, handle=plan.local_handle))[0]
            recv_xf = recv[0] if isinstance(recv, tuple) else recv
            x_out = self._rows(recv_xf, xv.dtype, xv.shape[1])[plan.order]
            if isinstance(recv, tuple):
                x_out = (x_out, recv[1][plan.order])
            return x_out, None, None, None, None, EventOverlap(None)
        R, E, idx, T = self.rt.group_size, prep.E, prep.idx, xv.shape[0]
        El = E // R
        base = self.host * self.per_host * El
        ids_local = torch.where((ids_f >= base) & (ids_f < base + self.per_host * El), ids_f - base, -1)
        ids_local = ids_local.to(idx.dtype)
        per_rank_f = in_f.sum(0, dtype=torch.int32)
        npe_f = torch.zeros(self.per_host * El, dtype=torch.int32)
        valid = ids_local[ids_local >= 0].long()
        npe_f.index_add_(0, valid, torch.ones_like(valid, dtype=torch.int32))
        dev = self.local_rt.device
        prep.local_started = True
        out = self._local_run(self.local.dispatch_steps(
            xs_f, None, per_rank_f.to(dev), None, in_f.to(dev), npe_f.to(dev), ids_local.to(dev), w_f,
            expert_alignment, num_worst_tokens))
        recv_x_f, recv_idx, recv_w, per_expert_list, local_handle, _ = out
        recv_xf = recv_x_f[0] if isinstance(recv_x_f, tuple) else recv_x_f
        recv_sc = recv_x_f[1] if isinstance(recv_x_f, tuple) else None
        meta = _field(recv_xf, 0, _META, torch.int32)
        n_rows = recv_xf.shape[0]
        meta[local_handle[3] < 0] = -1                 # padding rows (num_worst_tokens) carry no record
        key = torch.where(meta[:, 0] >= 0, meta[:, 0].long(), R)
        order = torch.sort(key, stable=True)[1]
        x_out = self._rows(recv_xf, xv.dtype, xv.shape[1])[order]
        x_ret = x_out if recv_sc is None else (x_out, recv_sc[order])
        src_meta = meta[order][:, :2].contiguous()
        recv_from = torch.bincount(src_meta[:, 0][src_meta[:, 0] >= 0].long(), minlength=R).to(torch.int32)
        self._seq += 1
        to_host, in_rank = prep.to_host, prep.in_rank
        plan = _Plan(self.rt.uid, self._seq, T, to_host, counts, local_handle, order, n_rows)
        head = torch.full((T, self.num_hosts), -1, dtype=torch.int32)
        for h in range(self.num_hosts):
            head[to_host[h].cpu(), h] = torch.arange(to_host[h].numel(), dtype=torch.int32)
        cnt = torch.tensor(counts, dtype=torch.int32)
        new_handle = InternodeHandle((
            in_rank, torch.tensor([t.numel() for t in to_host], dtype=torch.int32).view(-1, 1),
            in_rank.sum(0, dtype=torch.int32).view(-1, 1), cnt.view(-1, 1), torch.cumsum(cnt, 0, dtype=torch.int32),
            recv_from.view(-1, 1), torch.cumsum(recv_from, 0, dtype=torch.int32), src_meta, head.to(xv.device),
            local_handle[5]), plan)
        return (x_ret, recv_idx[order] if recv_idx is not None else None,
                recv_w[order] if recv_w is not None else None, per_expert_list, new_handle, EventOverlap(None))

    def _records(self, xv, sc, idx, w, in_rank, tokens: Tensor, host: int, rec: _Record) -> Tensor:
        """uint8 ``[len(tokens), rec.nbytes]``: the records of ``tokens`` (int64 indices) for ``host``."""
        n = tokens.numel()
        out = torch.zeros(n, rec.nbytes, dtype=torch.uint8)
        if n == 0:
            return out
        t = tokens.cpu()
        meta = torch.zeros(n, 4, dtype=torch.int32)
        meta[:, 0] = self.rt.rank
        meta[:, 1] = t.to(torch.int32)
        rec.put(out, "meta", meta)
        rec.put(out, "row", xv.cpu()[t])
        if rec.scales:
            rec.put(out, "scales", sc.cpu()[t])
        if rec.ids:
            rec.put(out, "ids", idx.cpu()[t].long())
        if rec.weights:
            rec.put(out, "weights", w.cpu()[t])
        if rec.local:
            rec.put(out, "local", in_rank.cpu()[t][:, list(self.hosts.ranks(host))].to(torch.uint8))
        return out

    def _split(self, fwd: Tensor, rec: _Record, dtype, sc_dtype):
        """The forwarded rows as the intranode dispatch takes them: ``x`` uint8 ``[F, 16 + row]`` (meta, then
        the row's bytes), scales, ids int64 ``[F, K]``, weights fp32 ``[F, K]`` or ``None``, is_token_in_rank
        bool ``[F, per_host]``."""
        dev = self.local_rt.device
        x_f = _field(fwd, 0, rec.span("row")[1], torch.uint8).to(dev)        # meta, then the row
        sc_f = rec.get(fwd, "scales", sc_dtype).to(dev) if rec.scales else None
        ids = rec.get(fwd, "ids", torch.int64) if rec.ids else None
        w = rec.get(fwd, "weights", torch.float32).to(dev) if rec.weights else None
        in_f = rec.get(fwd, "local", torch.bool) if rec.local else None
        return x_f, sc_f, ids, w, in_f

    @staticmethod
    def _rows(recv_xf: Tensor, dtype, hidden: int) -> Tensor:
        """The x rows of received records (uint8 ``[N, 16 + row]``) as ``dtype`` ``[N, hidden]``."""
        return _field(recv_xf, _META, recv_xf.shape[1], dtype)

    def _check_handle(self, handle) -> _Plan:
        plan = getattr(handle, "plan", None)
        if not isinstance(handle, InternodeHandle) or not isinstance(plan, _Plan) or plan.uid != self.rt.uid:
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
        self._live()
        prep = err = None
        try:
            prep = self._prepare_combine(x, handle, topk_weights, bias, previous_event)
        except Exception as e:   # noqa: BLE001 - this host's ranks and the RDMA peers are told, then it is raised
            err = e
            self._tell_host()
        parts = rec = None
        if err is None:
            try:
                parts, rec = self._reduce_in_host(prep)
            except Exception as e:   # noqa: BLE001 - the RDMA peers hear of it (this host's ranks failed alike)
                err = e
                if not prep.local_started:      # this host's ranks wait for this rank's part of the leg
                    self._tell_host()
        got, _ = self._exchange(self._sends(parts) if parts else None, rec, err, tell=False)
        plan, H, K = prep.plan, prep.H, prep.K
        got[self.host] = parts[self.host]
        T = plan.num_tokens
        acc = torch.zeros(T, H, dtype=torch.float32)
        wacc = torch.zeros(T, K, dtype=torch.float32) if K else None
        for h in range(self.num_hosts):
            t = plan.to_host[h].cpu()
            blk = got[h]
            acc[t] += rec.get(blk, "row", torch.bfloat16).float()
            if K:
                wacc[t] += rec.get(blk, "weights", torch.float32)
        for b in prep.biases:
            acc += b.cpu().float()
        dev = prep.xv.device
        return (acc.to(torch.bfloat16).to(dev), wacc.to(dev) if K else None, EventOverlap(None))

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

    def _reduce_in_host(self, prep: SimpleNamespace) -> Tuple[List[Tensor], _Record]:
        """The intranode combine of this host's rows (per forwarded token: the fp32 sum over the host's ranks,
        rounded to bf16), packed per source host: ``(records per host, their layout)``."""
        plan, H, K = prep.plan, prep.H, prep.K
        inv = torch.empty_like(plan.order)
        inv[plan.order] = torch.arange(plan.num_rows, device=plan.order.device)
        x_int = prep.xv[inv]
        w_int = prep.wv[inv] if K else None
        prep.local_started = True
        comb, comb_w, _ = self._local_run(self.local.combine_steps(x_int, plan.local_handle, w_int))
        starts = np.cumsum([0] + plan.from_host)
        rec = _Record(2 * H, 0, 0, K, 0)
        parts = []
        for h in range(self.num_hosts):
            lo, hi = int(starts[h]), int(starts[h + 1])
            blk = torch.zeros(hi - lo, rec.nbytes, dtype=torch.uint8)
            rec.put(blk, "row", comb[lo:hi].cpu())
            if K:
                rec.put(blk, "weights", comb_w[lo:hi].cpu())
            parts.append(blk)
        return parts, rec
