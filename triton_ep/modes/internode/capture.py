"""The capture path of internode normal mode: a ``num_worst_tokens`` dispatch across hosts, its cached
dispatches and its combines with no device synchronisation (a dispatch's one host exchange, the RDMA peers' token
counts through the group's store, needs no device work), so they can be captured in a CUDA graph.

The host path (:class:`~triton_ep.modes.internode.normal.Internode`) exchanges a small header with each RDMA peer per
call and numbers the ring's chunks on the host; here everything the host learnt there stays on the device:

- **Streams with a header.** Each stream to a peer host starts with
  :data:`~triton_ep.protocol.records.NET_HEADER_WORDS` int32 words (its length, its records, a status code,
  the rank whose error started a failure, the record layout's key), then, for a dispatch without ``topk_idx``,
  the sender's counts of that host's experts. The pack kernel writes it from a tensor built on the device; the
  unpack kernel reads it from the first chunk and learns how many chunks follow.
- **Chunk numbers from the ring's counters.** Each stream's first chunk number is the ring counter
  (``READY`` to send, ``HEAD`` to receive) when the call's first round starts: every earlier chunk was produced
  and consumed before (stream order). The host path re-reads the counters after waiting for the device
  (:meth:`~triton_ep.scheduler.Scheduler.resync`).
- **Sizes from num_worst_tokens.** Rank ``r`` receives at most its own ``W_r = num_worst_tokens`` rows (the
  ranks may pass different values, as in DeepEP), so a host's ranks receive at most ``C``, the sum of their
  ``W_r`` (they read each other's values from their call cards, :meth:`Intranode.worst_steps`), and each
  record crossing the network gives at least one of those rows. A peer host sends this rank at most its RDMA
  peer's token count ``T_h`` records (each token once), which the RDMA peers post in the group's key-value store
  (:mod:`.peer_tokens`: a host wait, no device work): this rank's staging area for each host holds
  ``min(C, max(T, T_h...))`` records (``C`` without a store). Each stream's header names its sender's room; a
  stream of more records than its receiver's room ends with its first round's chunks on both sides, and the
  receiver notes a capacity status. No rank assumes another's sizes: each rank's rounds (launches) follow from
  its own room, its own token count and the record size, and cover every chunk it sends or receives.
- **Errors at the next call or check().** The header's status (this rank's own: bad ``topk_idx`` ids,
  ``num_tokens_per_rdma_rank`` that differs from the routing, negative ``num_tokens_per_expert``; a peer's:
  its failure, more records than fit, another layout) lands in pinned host memory; the next call or
  ``Buffer.check()`` raises it. Such an error ends the network leg for good (the RDMA peers hear it from the
  fault word, this host's ranks from the failure word): destroy and rebuild the Buffer. Argument errors found
  on the host (shapes, dtypes) do the same, since the peers' kernels already wait for this rank's streams.
  Ranks that disagree (another operation or other sizes) raise the same ``ValueError`` everywhere, naming the
  field and two ranks' values: the failing ranks exchange their call cards in the group's key-value store on
  this error path only, and the rank that found it tells the others there before the leg ends
  (:mod:`.cards`).

This path takes every ``num_worst_tokens`` dispatch on a CUDA device (so the warm-up call before a capture
compiles the same kernels), and the cached dispatches and combines of its handles and of plain dispatches'
handles (whose counts the host learnt: :meth:`CapturePlan.of_plain`), so those capture in a graph too.
``TRITON_EP_INTERNODE_CAPTURE_PATH=1`` sends such calls down it on any device (the CPU tests), ``=0`` down the
host path (except while a graph is captured); every rank must set the same. Its results are bit for bit
those of the host path.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from ... import scheduler as sched_mod
from ...config import EventOverlap
from ...errors import EPCapacityError, EPRemoteError
from ...kernels import net
from ...kernels._util import cdiv
from ...protocol import call_card
from ...protocol.records import (NET_HEADER_WORDS, NET_STATUS_CAPACITY, NET_STATUS_FAILED, NET_STATUS_LAYOUT,
                                NetRecord)
from ...runtime.fabric import group_store
from .cards import CaptureCards
from .combine import combine_args, combine_in_host
from .forward import dispatch_results, forward_cached, forward_fresh
from .handle import CapturePlan, build_handle
from .peer_tokens import PeerTokens
from .records import Records, record_field, row_sums, split_records

Tensor = torch.Tensor
#: the operation of a capture-path stream, part of its layout key
OP_DISPATCH, OP_CACHED, OP_COMBINE = 1, 2, 3
#: this rank's own status reasons (header word 5)
_REASONS = {1: "topk_idx held ids outside [-1, num_experts) (they were masked)",
            2: "num_tokens_per_rdma_rank differed from the tokens this rank sends to each host",
            3: "num_tokens_per_expert held negative counts"}


@dataclasses.dataclass
class CaptureRoute:
    """A capture-path dispatch's routing (on the device; nothing read on the host)."""
    in_rank: Tensor                 # bool [T, R]: is_token_in_rank
    host_mask: Tensor               # bool [T, num_hosts]: token t goes to at least one rank of host h
    cnt: Tensor                     # int64 [num_hosts]: tokens sent to each host
    pos: Tensor                     # int64 [T, num_hosts]: token t's index among those sent to host h (-1 where not)
    tok: Tensor                     # int64 [num_hosts, T]: per host, the tokens sent there, ascending (first cnt[h])
    reason: Tensor                  # int32 []: this rank's own status reason (0: none; _REASONS)
    code: Tensor                    # int32 []: its status code (NET_STATUS_FAILED where reason != 0)


class CapturePath:
    """The capture path's calls and state, a part of :class:`~triton_ep.modes.internode.normal.Internode`: it takes
    the calls :meth:`takes` picks and runs the host path's own steps (argument checks, record layout and sources,
    the ring kernels' rounds, the forwarding leg) through ``leg``.

    Args:
        leg: the :class:`~triton_ep.modes.internode.normal.Internode` that holds this path (its scheduler, call
            count and steps are read from it at each call; ``rt``, ``hosts``, ``host``, ``num_hosts``,
            ``per_host`` and ``local``, fixed once it is built, are kept here too).
        mode: ``TRITON_EP_INTERNODE_CAPTURE_PATH`` (``None``: unset, the capture path on CUDA only).
    """

    def __init__(self, leg, mode: Optional[bool]) -> None:
        self.leg = leg
        self.rt, self.hosts, self.host, self.local = leg.rt, leg.hosts, leg.host, leg.local
        self.num_hosts, self.per_host = leg.num_hosts, leg.per_host
        dev = self.rt.device
        #: int32 [num_hosts, 2]: the capture path's statuses (code, culprit / reason), pinned on GPU so the
        #: host reads them without a synchronisation
        self._cstatus = torch.zeros(self.num_hosts, 2, dtype=torch.int32, device="cpu", pin_memory=dev.type == "cuda")
        #: num_worst_tokens calls take this path (:meth:`takes`) on CUDA, or as TRITON_EP_INTERNODE_CAPTURE_PATH says
        self.mode = dev.type == "cuda" if mode is None else mode
        #: a capture-path call was made (or captured: its replays advance the ring counters unseen)
        self._capture_used = False
        #: this host's ranks' num_worst_tokens at the latest capture-path dispatch (its staging areas' room)
        self._host_worst: List[int] = []
        #: the records its staging areas took where the RDMA peers' token counts bounded them below the sum of
        #: ``_host_worst`` (``None``: that sum bounded them)
        self._tokens_bound: Optional[int] = None
        #: this rank's call card and the store where ranks that disagree exchange theirs (:meth:`open_store`)
        self.cards = CaptureCards(self.rt)
        #: the RDMA peers' token counts, which bound the staging areas (:mod:`.peer_tokens`)
        self.peer_tokens = PeerTokens(self.rt.rank, [leg.rings.peer_rank(h) for h in leg.peer_hosts],
                                      self.rt.timeout_s)
        #: bytes of the largest staging areas a capture-path call took so far
        #: (``get_rdma_stats()["capture_staging_bytes"]``)
        self.staging_bytes = 0

    def open_store(self, group, token: str) -> None:
        """``token``: the Buffer's fabric token (the same on every rank)."""
        store = group_store(group)
        self.cards.open(store, f"triton_ep/capture/{token}/")
        self.peer_tokens.open(store, f"triton_ep/capture/{token}/")

    def close(self) -> None:
        """Delete this rank's token-count keys from the group's store and end the worker of its bounded store calls.
        Never raises."""
        try:
            if self.peer_tokens.store is not None:
                self.peer_tokens.forget()
        finally:
            self.peer_tokens.close()

    def takes(self, num_worst_tokens: int = 0, handle=None) -> bool:
        """Whether a call takes the capture path: a cached dispatch or combine of a handle it made; a
        ``num_worst_tokens`` dispatch on a CUDA device (``TRITON_EP_INTERNODE_CAPTURE_PATH=1``: on any device;
        ``=0``: nowhere) or while a CUDA graph is captured."""
        if handle is not None:
            return isinstance(getattr(handle, "plan", None), CapturePlan)
        if not num_worst_tokens:
            return False
        return self.mode or (self.rt.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def sync_host_path(self) -> None:
        """Before a host-path exchange: once any capture-path call was made, wait for the work queued on the
        device (graph replays included) and take the scheduler's chunk numbers from the ring counters."""
        if self._capture_used:
            self.leg.rings.wait_device()
            self.leg.sched.resync()

    def check(self) -> None:
        """Raise what a capture-path call's status recorded (pinned host memory; no synchronisation). Any
        such error ends the network leg for good (the RDMA peers and this host's ranks are told)."""
        st = self._cstatus.numpy()
        if not st[:, 0].any():
            return
        rows = [(h, int(st[h, 0]), int(st[h, 1])) for h in range(self.num_hosts) if st[h, 0]]
        st[:] = 0
        me = self.rt.rank
        h, code, extra = next(((h, c, e) for h, c, e in rows if h == self.host), rows[0])
        room = (f"its ranks' num_worst_tokens add up to ({sum(self._host_worst)}: "
                + ", ".join(f"rank {r}: {w}" for r, w in zip(self.hosts.ranks(self.host), self._host_worst)) + ")")
        if h == self.host:
            if code == NET_STATUS_CAPACITY:
                ex = EPCapacityError(f"rank {me}: a num_worst_tokens dispatch sent its own host more records than "
                                     f"{room}: a num_worst_tokens of those ranks is too small")
            else:
                ex = ValueError(f"rank {me}: in a num_worst_tokens call across hosts, "
                                f"{_REASONS.get(extra, 'an argument was bad')}")
        else:
            peer = self.leg.rings.peer_rank(h)
            if code == NET_STATUS_CAPACITY and self._tokens_bound is not None:
                ex = EPCapacityError(f"rank {me}: rank {peer} (host {h}) sent this host (host {self.host}) more "
                                     f"records than the {self._tokens_bound} its staging area took, the most "
                                     f"tokens its RDMA peers and itself said they had (below what {room}): a peer "
                                     f"sent more records than its token count")
            elif code == NET_STATUS_CAPACITY:
                ex = EPCapacityError(f"rank {me}: rank {peer} (host {h}) sent this host (host {self.host}) more "
                                     f"records than {room}: a num_worst_tokens of those ranks is too small")
            elif code == NET_STATUS_LAYOUT:
                d = self.cards.compare(peer)
                ex = d.error(me) if d is not None else ValueError(
                    f"rank {me}: rank {peer} (host {h}) sent records of another layout: the ranks called with "
                    f"different arguments or made different calls (a combine against a cached dispatch; "
                    f"num_worst_tokens > 0 on one rank and 0 on another)")
                ex._ep_mismatch = True
            else:
                who = f"rank {extra} (host {self.hosts.host_of[extra]})" if 0 <= extra < self.rt.group_size else \
                    f"rank {peer} (host {h})"
                ex = EPRemoteError(f"rank {me}: {who} failed a num_worst_tokens call across hosts (its own error "
                                   f"names why)")
        self._fail_for_good(ex)
        raise ex

    def _fail_for_good(self, ex: BaseException) -> None:
        """A capture-path call failed: end the network leg (the RDMA peers' waits end at once) and leave this
        host's group, so every later call of every rank raises at once. First this rank's call card goes to the
        group's store (a rank that found a disagreement with this one names its values from it), and where ``ex``
        is a disagreement it is told there too (:meth:`CaptureCards.tell`), before any rank can hear of the failure."""
        self.cards.post()
        if getattr(ex, "_ep_mismatch", False):
            self.cards.tell(ex)
            self.cards.raised = True
        if self.leg.sched is not None and self.leg.sched.error is None:
            self.leg.sched.fail(self.leg.host_ranks.rooted(EPRemoteError(
                f"rank {self.rt.rank}: a num_worst_tokens call across hosts failed ({type(ex).__name__}: {ex}); "
                f"destroy() and rebuild the Buffer")))
        self.leg.host_ranks.leave(ex)

    def _capture_call(self, body, *args):
        """One capture-path call, ``body(*args)``: any error it raises (an argument check on the host, this
        host's forwarding leg) ends the network leg for good, since the peers' kernels already count on
        this rank's streams."""
        self.cards.card = ()
        try:
            return body(*args)
        except Exception as ex:   # noqa: BLE001 - told to the peers, then raised
            told = self.cards.as_disagreement(ex)
            self._fail_for_good(told)
            if told is not ex:
                raise told from ex
            raise
        finally:
            self._capture_used = True

    def translate_failure(self, ex: BaseException) -> BaseException:
        """What a rank raises for ``ex``, the network leg's failure seen at a call's start or ``check()``: the
        disagreement a rank told, the first time (:meth:`CaptureCards.told`), else ``ex``."""
        if self.cards.raised or not self._capture_used or isinstance(ex, (ValueError, TypeError)):
            return ex
        told = self.cards.told()
        if told is None:
            return ex
        self.cards.raised = True
        return told

    # ------------------------------------------------------------------ the network leg
    def _move_capture(self, op: int, rec: NetRecord, src: net.Sources, tok: Tensor, cnt: Tensor, cap_rx: int,
                      extra: Optional[Tensor] = None, code: Optional[Tensor] = None,
                      reason: Optional[Tensor] = None, own_cap: bool = False) -> Tuple[Tensor, Tensor, int]:
        """Send each host ``cnt[h]`` records of ``tok[h]`` (int64 ``[num_hosts, n]``; ``cnt`` int64
        ``[num_hosts]`` on the device) with a header (``extra``: int32 ``[num_hosts, e]`` more words; ``code`` /
        ``reason``: int32 ``[]`` this rank's own status) and receive each peer's into staging areas of
        ``cap_rx`` records each. Each header names the room of its sender's staging areas (``cap_rx``): a
        stream of more records than its receiver takes is cut on both sides (:func:`net.pack_ring`) and the
        receiver notes a capacity status; so ranks may size their staging areas differently (per-rank
        ``num_worst_tokens``) and the launches of each follow from its own sizes. ``own_cap``: more than
        ``cap_rx`` records for this rank's own host are its own capacity status. ``op`` (:data:`OP_DISPATCH`,
        :data:`OP_CACHED`, :data:`OP_COMBINE`) is part of the layout key, so a combine meeting a cached dispatch
        of the same record size is a layout status too.

        Returns: the staging area int32 ``[num_hosts, hw + cap_rx * rec_w]`` (each host's header, then its
        records; this host's: this rank's own), the records per host (int32 ``[num_hosts]``), and ``hw``.
        """
        sched, dev, nh, me = self.leg.sched, self.rt.device, self.num_hosts, self.host
        rw = rec.nbytes // 4
        ne = 0 if extra is None else extra.shape[1]
        hw = NET_HEADER_WORDS + cdiv(ne, 4) * 4
        n = tok.shape[1]
        cnt = cnt.to(torch.int64)
        st = torch.zeros(nh, dtype=torch.int32, device=dev) if code is None else code.expand(nh).clone()
        if own_cap:
            st[me] = torch.where((cnt[me] > cap_rx) & (st[me] == 0), NET_STATUS_CAPACITY, st[me])
        hdr = torch.zeros(nh, hw, dtype=torch.int32, device=dev)
        hdr[:, 0] = (cnt * rw + hw).to(torch.int32)
        hdr[:, 1] = cnt.to(torch.int32)
        hdr[:, 2] = st
        hdr[:, 3] = torch.where(st == NET_STATUS_FAILED, self.rt.rank, -1)
        key = rec.key32(hw, op)
        hdr[:, 4] = key
        hdr[:, 6] = cap_rx
        if reason is not None:
            hdr[:, 5] = reason
        if ne:
            hdr[:, NET_HEADER_WORDS:NET_HEADER_WORDS + ne] = extra
        region = hw + cap_rx * rw
        out = torch.empty(nh, region, dtype=torch.int32, device=dev)
        self.staging_bytes = max(self.staging_bytes, out.numel() * out.element_size())
        out[me, :hw] = hdr[me]
        own = tok[me, :min(n, cap_rx)]
        net.pack_linear(out[me, hw:], src, own, me, count=cnt[me:me + 1])
        rx = torch.zeros(nh, dtype=torch.int32, device=dev)         # (a peer whose header never came: none)
        S, SW = sched.slots, sched.slot_bytes // 4
        rounds = cdiv(max(cdiv(hw + n * rw, SW), cdiv(region, SW)), S)
        n_rx = torch.zeros(3 * nh, dtype=torch.int64, device=dev)     # (a header that never came: nothing)
        cd = net.DeviceCounts(hdr, hw, rx, n_rx, self._cstatus, cap_rx * rw, key, rw)
        ar = torch.arange(nh, dtype=torch.int64, device=dev)
        tokens = tok[:, :n].contiguous().view(-1) if n else torch.zeros(1, dtype=torch.int64, device=dev)
        tok_start, out_start = ar * n, ar * region
        n_tx = hdr[:, 0].to(torch.int64)
        f_tx, f_rx = (torch.empty(nh, dtype=torch.int64, device=dev) for _ in range(2))
        with self.leg.rings.network():
            self.leg.rings.rounds(rounds, src, tokens, tok_start, n_tx, f_tx, out.view(-1), out_start, n_rx, f_rx,
                                  dev=cd)
        rx[me] = cnt[me].clamp(max=cap_rx).to(torch.int32)
        return out, rx, hw

    def _records(self, out: Tensor, hw: int, rec: NetRecord, cap: int) -> Tensor:
        """The records of a staging area (int32 ``[num_hosts, hw + cap * rec_w]``) as uint8 ``[num_hosts, cap,
        rec.nbytes]``, host by host: a view (each field is copied out of it once, :func:`split_records`)."""
        return out[:, hw:].view(torch.uint8).view(self.num_hosts, cap, rec.nbytes)

    def _forwarded(self, out: Tensor, hw: int, rec: NetRecord, plan: CapturePlan) -> Records:
        """The records the forwarding leg takes, laid out as ``plan``'s dispatch had them: the staging areas
        as they are, or (``plan.blocks``) each host's first ``blocks[h]`` records, one host after another (views of
        the staging areas, each a block of :data:`~.records.Records`)."""
        if plan.blocks is None:
            return self._records(out, hw, rec, plan.cap)
        rw = rec.nbytes // 4
        return [out[h, hw:hw + n * rw].view(torch.uint8).view(n, rec.nbytes) for h, n in enumerate(plan.blocks)]

    def _valid(self, rx: Tensor, cap: int) -> Tensor:
        """bool ``[num_hosts * cap]``: which staging rows hold a received record."""
        return (torch.arange(cap, dtype=torch.int64, device=rx.device)[None, :] < rx[:, None]).view(-1)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                 num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event):
        """:meth:`Internode.dispatch` on the capture path (same arguments and results)."""
        if handle is not None:
            return self._capture_call(self._cached_capture, x, handle, topk_idx, topk_weights, previous_event)
        return self._capture_call(self._dispatch_capture, x, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                  is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                  num_worst_tokens, previous_event)

    def _dispatch_capture(self, x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                          num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                          previous_event):
        f = self.leg.fresh(x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                           topk_idx, topk_weights, expert_alignment, num_worst_tokens, previous_event)
        a = f.args
        self.cards.card = f.card
        seq, T = self.leg._calls, a.num_tokens
        self.peer_tokens.post(seq, T)       # (first: the peers' waits for it overlap this host's exchange)
        # this host's ranks' values (each may pass its own): a record gives at least one row on this host
        self._host_worst = self.leg.host_ranks.run(self.local.worst_steps(a, num_worst_tokens))
        C = sum(self._host_worst)
        if C >= 1 << 31:        # (the same on every rank of the host: they all raise here)
            raise ValueError(f"rank {self.rt.rank}: the num_worst_tokens of host {self.host}'s ranks add up to {C} "
                             f"({', '.join(map(str, self._host_worst))}), more than a stream can count (2^31 - 1)")
        C = self._room(seq, T, C)
        route = self._route(a, num_tokens_per_rdma_rank)
        ids = None if a.topk_idx is None else a.topk_idx.long()
        src = self.leg.row_sources(f.rec, T, f.rows.x, f.rows.scales, ids, a.topk_weights, route.in_rank)
        nh, E = self.num_hosts, a.num_experts
        extra = None if a.topk_idx is not None else a.num_tokens_per_expert.to(torch.int32).view(nh, E // nh)
        out, rx, hw = self._move_capture(OP_DISPATCH, f.rec, src, route.tok, route.cnt, C, extra, route.code,
                                         route.reason, own_cap=True)
        npe_f = None
        if a.topk_idx is None:      # the senders' counts of this host's experts, from their headers
            npe_f = out[:, NET_HEADER_WORDS:NET_HEADER_WORDS + self.per_host * (E // self.rt.group_size)].sum(
                0, dtype=torch.int32)
        sc = f.rows.scales
        fwd = split_records(self._records(out, hw, f.rec, C), f.rec, None if sc is None else sc.dtype,
                            self.leg.host_ranks.local_rt.device)
        del out         # (its fields were copied out: the staging areas go before the forwarding leg's outputs come)
        rows = forward_fresh(self.leg, fwd, a, f.rows.x.dtype, npe_f, self._valid(rx, C), expert_alignment,
                             num_worst_tokens)
        return dispatch_results(rows, self._handle(route, C, rx, rows, T, num_worst_tokens),
                                per_expert=False)

    def _room(self, seq: int, num_tokens: int, C: int) -> int:
        """Records per staging area of the dispatch ``seq``: ``C``, or (where the RDMA peers' token counts came,
        :mod:`.peer_tokens`) at most the largest of theirs and this rank's ``num_tokens`` (a host gets each token
        of a rank at most once), at least 1."""
        got = self.peer_tokens.gather(seq, self._network_check)
        room = C if got is None else max(1, min(C, max([num_tokens] + got)))
        self._tokens_bound = room if room < C else None
        return room

    def _network_check(self) -> None:
        """Raise the network leg's failure (the proxy's, with global ranks), as the ring waits would."""
        try:
            self.leg.sched.check()
        except sched_mod.ProxyError as ex:
            self.leg.host_ranks.leave()
            raise self.leg.rings.global_error(ex) from ex

    def _route(self, a, num_tokens_per_rdma_rank: Tensor) -> "CaptureRoute":
        """A capture-path dispatch's routing, on the device: each host's tokens and this rank's status (its own
        errors as a reason code, raised at the next call or ``check()``)."""
        dev, nh, T = self.rt.device, self.num_hosts, a.num_tokens
        _, _, in_rank, _, num_bad, _ = self.leg.intranode._routing(a)
        host_mask = self.leg.host_mask(in_rank)
        cnt = host_mask.sum(0)
        reason = torch.zeros((), dtype=torch.int32, device=dev)
        if a.topk_idx is not None:
            reason = torch.where(num_bad.view(()) > 0, 1, reason)
        else:
            reason = torch.where((a.num_tokens_per_expert < 0).any(), 3, reason)
        given = num_tokens_per_rdma_rank.to(torch.int64)
        reason = torch.where((reason == 0) & (given != cnt).any(), 2, reason).to(torch.int32)
        code = torch.where(reason != 0, NET_STATUS_FAILED, 0).to(torch.int32)
        pos = host_mask.to(torch.int64).cumsum(0) - 1
        slot = torch.where(host_mask, torch.arange(nh, dtype=torch.int64, device=dev)[None, :] * T + pos, nh * T)
        tok = torch.zeros(nh * T + 1, dtype=torch.int64, device=dev)
        tokens = torch.arange(T, dtype=torch.int64, device=dev)[:, None].expand(T, nh).reshape(-1)
        tok.scatter_(0, slot.view(-1), tokens)
        return CaptureRoute(in_rank, host_mask, cnt, pos, tok[:nh * T].view(nh, T), reason, code)

    def _handle(self, route: "CaptureRoute", C: int, rx: Tensor, rows, num_tokens: int, num_worst_tokens: int):
        """The handle of a capture-path dispatch and its plan (everything on the device)."""
        dev, nh = self.rt.device, self.num_hosts
        cnt_c = route.cnt.clone()
        cnt_c[self.host] = cnt_c[self.host].clamp(max=C)
        ctok = torch.arange(nh * C, dtype=torch.int64, device=dev).view(nh, C)
        plan = CapturePlan(self.rt.uid, self.leg._calls, num_tokens, route.tok, cnt_c, C, rx, rows.local_handle,
                           rows.order, num_worst_tokens, ctok)
        head = torch.where(route.host_mask, route.pos, -1).to(torch.int32)
        return build_handle(route.in_rank, cnt_c.to(torch.int32), rx, rows, head, plan)

    def _cached_capture(self, x, handle, topk_idx, topk_weights, previous_event):
        c = self.leg.cached_args(x, handle, topk_idx, topk_weights, previous_event)
        plan, rec, sc = c.plan, c.rec, c.rows.scales
        self.cards.card = c.card
        # a num_worst_tokens plan's own records must fit (the peers' receivers check theirs); a plain one's
        # counts are exact
        out, rx, hw = self._move_capture(OP_CACHED, rec, c.src, plan.tok, plan.cnt, plan.cap,
                                         own_cap=plan.blocks is None)
        fwd = split_records(self._forwarded(out, hw, rec, plan), rec, None if sc is None else sc.dtype,
                            self.leg.host_ranks.local_rt.device)
        del out         # (as in a dispatch: the staging areas go before the forwarding leg's outputs come)
        return forward_cached(self.leg, fwd, plan, c.rows.x.dtype, c.rows.x.shape[1])

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle, topk_weights, bias, previous_event):
        """:meth:`Internode.combine` on the capture path (same arguments and results)."""
        return self._capture_call(self._combine_capture, x, handle, topk_weights, bias, previous_event)

    def _combine_capture(self, x, handle, topk_weights, bias, previous_event):
        prep = combine_args(self.leg, x, handle, topk_weights, bias, previous_event)
        plan, H, K = prep.plan, prep.hidden, prep.num_topk
        dev, nh, T = self.rt.device, self.num_hosts, plan.num_tokens
        self.cards.card = (call_card.COMBINE, H, K, plan.seq)
        rec, src, _ = combine_in_host(self.leg, prep)
        out, rx, hw = self._move_capture(OP_COMBINE, rec, src, plan.ctok, plan.rx, T)
        del src         # (this host's sums, sent: they go before the sums over hosts are made)
        got = self._records(out, hw, rec, T)
        acc = torch.zeros(T + 1, H, dtype=torch.float32, device=dev)      # row T: where unused rows go
        wacc = torch.zeros(T + 1, K, dtype=torch.float32, device=dev) if K else None
        valid = self._valid(rx, T).view(nh, T)
        ws = record_field(rec, got, "weights", torch.float32).view(nh, T, K) if K else None
        for h in range(nh):          # ascending host order; each token at most once per host
            t = torch.where(valid[h], plan.tok[h], T)
            acc.index_add_(0, t, row_sums(rec, got[h], H))      # (one host's rows in fp32 at a time)
            if K:
                wacc.index_add_(0, t, ws[h])
        acc = acc[:T]
        for b in prep.biases:
            acc += b.float()
        return acc.to(torch.bfloat16), None if wacc is None else wacc[:T], EventOverlap(None)
