"""The host path's headers with the RDMA peers in internode normal mode (:class:`HostExchange`): per call, a
small header through host memory (a status, the record count, the record layout and the call card, which must
agree), before the records go through the ring kernels (:meth:`~.rings.Rings.exchange`); after the forwarding
leg, a status alone. The capture path (:mod:`.capture`) makes none of these: it keeps all on the device."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import torch

from ... import scheduler as sched_mod
from ...errors import EPCapacityError, EPError, EPRemoteError
from ...protocol.records import (HOST_CAPACITY, HOST_FAILED, HOST_GONE, HOST_HEADER_WORDS, HOST_KEY_WORDS,
                                HOST_MISMATCH, HOST_OK, HostHeader)
from ...runtime import hosts as hosts_mod
from ...runtime.fabric import dead_error
from .peer_tokens import MARK_AFTER_S
from .records import Streams

Tensor = torch.Tensor
#: the host path's header and its status codes (protocol/records.py)
_KEY_WORDS, HEADER_WORDS = HOST_KEY_WORDS, HOST_HEADER_WORDS
_OK, _FAILED, _CAPACITY, _MISMATCH, _GONE = HOST_OK, HOST_FAILED, HOST_CAPACITY, HOST_MISMATCH, HOST_GONE
#: the record layout's key words, as errors name them
_KEY_FIELDS = ("row bytes", "scale bytes", "top-k", "weights", "ranks per host", "experts without top-k")


def told_gone(rank: int, gone: int, stage: str, told_by: int, told_host: int) -> EPRemoteError:
    """The error of a rank that heard from its RDMA peer ``told_by`` (on host ``told_host``) that rank ``gone``'s
    process is gone (the header's ``HOST_GONE``): :func:`~triton_ep.transport.liveness.dead_error` naming ``gone``
    (``failed_rank``, ``dead_ranks``, ``culprit``) at ``stage``, where this rank waited, and who told it
    (``told_by``)."""
    ex = dead_error(rank, [gone], stage)
    ex.args = (f"{ex.args[0]} (rank {told_by} on host {told_host} found it, or heard of it, and told this rank)",)
    ex.culprit, ex.told_by = gone, told_by
    return ex


def passed_on(err: Optional[BaseException]) -> bool:
    """Whether ``err`` only says that another rank failed or did not answer (an ``EPError`` that names no dead rank,
    no disagreement and no capacity overflow): a peer that knows which rank's process is gone then names it."""
    return isinstance(err, EPError) and not isinstance(err, EPCapacityError) and \
        not getattr(err, "dead_ranks", None) and getattr(err, "disagreement", None) is None


class HostExchange:
    """The host path's exchanges of one :class:`~triton_ep.modes.internode.normal.Internode` (``leg``: its
    scheduler, peers, counters and ring rounds are read from it at each call)."""

    def __init__(self, leg) -> None:
        self.leg = leg

    def status(self, err: Optional[BaseException]) -> None:
        """After the forwarding leg: tell the RDMA peers whether this rank's part succeeded and hear theirs
        (every rank of a host fails such a leg alike, so each rank hears of a host that failed from its own
        peer there). Raises ``err``, else the first peer's failure; where a peer says that a rank's process is gone
        and ``err`` only passes on another rank's failure (:func:`passed_on`), the dead rank's error instead."""
        with self.leg.rings.network():
            self.headers(None, err)
        if err is not None:
            raise err

    def headers(self, streams: Optional[Streams], err: Optional[BaseException] = None) -> List[int]:
        """The header exchange of :meth:`~.rings.Rings.exchange` (``streams`` ``None``: a status alone; ``err``: this rank
        failed, and says so: ``HOST_GONE`` naming the dead rank where ``err`` names one, ``err.dead_ranks``).
        Returns the record counts per host (this host's: its own stream's); raises the peers' failures (not
        ``err``: the caller raises it outside the network's error translation, unless a peer names a dead rank and
        ``err`` only passes on another's failure: then :func:`told_gone`)."""
        leg = self.leg
        leg.capture.sync_host_path()
        leg.host_exchanges += 1
        peers, mine = leg.peer_hosts, self._header(streams, err)
        count = (lambda h: 0) if streams is None or err is not None else streams.count
        head = {h: np.array(dataclasses.replace(mine, records=count(h)).words(), np.int64).view(np.uint8)
                for h in peers}
        got = sched_mod.host_alltoall(leg.sched, head, {h: 8 * HEADER_WORDS for h in peers},
                                      self._marker(streams is not None and err is None))
        theirs = {h: HostHeader.of_words(got[h].view(np.int64)) for h in peers}
        for h in peers:     # a capture-path stream read as a header: the ranks took different paths
            if err is None and not theirs[h].readable(leg.rt.group_size):
                raise ValueError(f"rank {leg.rt.rank}: rank {leg.rings.peer_rank(h)} (host {h}) sent no header this "
                                 f"call can read: the ranks made different calls (num_worst_tokens > 0 on every "
                                 f"rank, or on none; TRITON_EP_INTERNODE_CAPTURE_PATH the same on every rank)")
        self._raise_gone(theirs, err)
        if err is not None:
            return [0] * leg.num_hosts
        self._raise_failures(theirs)
        self._compare(theirs, mine, streams)
        if leg.capture.peer_tokens.posted:      # (every peer is at this call: none reads this rank's keys)
            leg.capture.peer_tokens.forget()
        counts = [0] * leg.num_hosts
        for h in peers:
            counts[h] = theirs[h].records
        if streams is not None:
            counts[leg.host] = streams.count(leg.host)
        return counts

    def _marker(self, calls: bool):
        """``host_alltoall``'s ``on_idle`` for a call's header exchange (``calls``; else none): after
        :data:`~.peer_tokens.MARK_AFTER_S` without the peers' headers, tell a peer that may wait for this rank's
        token count on the capture path (another call there) that this call took the host path, once
        (:meth:`~.peer_tokens.PeerTokens.mark_host_path`)."""
        if not calls:
            return None
        tokens, seq, marked = self.leg.capture.peer_tokens, self.leg._calls, []

        def on_idle(waited_s: float) -> None:
            if waited_s > MARK_AFTER_S and not marked:
                marked.append(seq)
                tokens.mark_host_path(seq)
        return on_idle

    def _header(self, streams: Optional[Streams], err: Optional[BaseException]) -> HostHeader:
        """This rank's header (its record count set per peer host by :meth:`headers`): the status of ``err``, the
        rank that started it, the record layout's key, and the call card and disagreement ``err`` carries."""
        key = (0,) * _KEY_WORDS if streams is None else \
            streams.rec.key() + (0 if streams.npe is None else streams.npe.shape[0],)
        card = tuple(streams.card) if streams is not None and err is None else ()
        told = getattr(err, "disagreement", None)
        # a rank whose process is gone (global rank; found by this rank, its host's ranks, or an RDMA peer)
        dead = getattr(err, "dead_ranks", None) if err is not None else None
        code = _OK if err is None else (_CAPACITY if isinstance(err, EPCapacityError) else
                                        _MISMATCH if told is not None else _GONE if dead else _FAILED)
        # the rank whose own error started a failure, or whose process is gone (-1: unknown, e.g. heard in a host's
        # forwarding leg)
        culprit = -1 if err is None else dead[0] if dead else \
            getattr(err, "culprit", -1 if isinstance(err, EPError) else self.leg.rt.rank)
        return HostHeader(code, 0, culprit, tuple(key), card, tuple(told.words()) if told is not None else ())

    def _raise_gone(self, theirs: Dict[int, HostHeader], err: Optional[BaseException]) -> None:
        """Where a peer knows which rank's process is gone (``HOST_GONE`` naming it), raise that as this call's error
        here too (:func:`told_gone`), unless this rank's own ``err`` says more than that another rank failed."""
        leg = self.leg
        gone = next((h for h, hd in theirs.items() if hd.status == _GONE and hd.culprit >= 0), None)
        if gone is not None and (err is None or passed_on(err)):
            at = "rdma host exchange (the call's headers)" if err is None else \
                getattr(err, "stage", None) or f"the forwarding leg of host {leg.host}"
            raise told_gone(leg.rt.rank, theirs[gone].culprit, at, leg.rings.peer_rank(gone), gone) from err

    def _raise_failures(self, theirs: Dict[int, HostHeader]) -> None:
        """Raise the first failure a peer's header tells: a disagreement found anywhere (this call's error on every
        rank), else ``EPCapacityError`` / ``EPRemoteError`` naming the rank that started it."""
        leg = self.leg
        for h, hd in theirs.items():
            d = hosts_mod.Disagreement.of_words(hd.disagreement) if hd.status == _MISMATCH else None
            if d is not None:
                raise d.error(leg.rt.rank)
        for h, hd in theirs.items():
            if hd.status:
                peer, first = leg.rings.peer_rank(h), hd.culprit
                who = f"rank {peer} (host {h})"
                if first >= 0 and first != peer:
                    who = f"rank {first} (host {leg.hosts.host_of[first]}; rank {peer} on host {h} passed it on)"
                if hd.status == _CAPACITY:
                    ex = EPCapacityError(f"rank {leg.rt.rank}: {who} found more rows than num_worst_tokens on its "
                                         f"host; no rank returns from this dispatch")
                else:
                    ex = EPRemoteError(f"rank {leg.rt.rank}: {who} failed this call (its own error names why); "
                                       f"this rank stopped too")
                ex.culprit = first if first >= 0 else peer
                raise ex

    def _compare(self, theirs: Dict[int, HostHeader], mine: HostHeader, streams: Optional[Streams]) -> None:
        """The RDMA peers compare their calls (the lower rank first, on both sides), then the record layouts (calls
        that agree give records of one layout: this names what still differs). Raises ``ValueError``."""
        leg = self.leg
        for h, hd in theirs.items():
            if mine.card and hd.card[0]:
                d = hosts_mod.Disagreement.of_cards(mine.card, hd.card, leg.rt.rank, leg.rings.peer_rank(h))
                if d is not None:
                    raise d.error(leg.rt.rank)
        for h, hd in theirs.items():
            if streams is not None and hd.key != mine.key:
                diff = "; ".join(f"{n}: rank {leg.rings.peer_rank(h)} sends {a}, rank {leg.rt.rank} sends {b}"
                                 for n, a, b in zip(_KEY_FIELDS, hd.key, mine.key) if a != b)
                raise ValueError(f"rank {leg.rt.rank}: ranks disagree across hosts on the records of this call "
                                 f"({diff}): the ranks called with different arguments")

    def expert_counts(self, npe: Tensor) -> Tensor:
        """A dispatch without ``topk_idx``: send each RDMA peer the counts of its host's experts in ``npe``
        (int32 ``[E]``) and return this host's experts' counts summed over this rank and its peers (int32
        ``[ranks per host * E / R]``, on the device): what this rank's forwarding leg delivers."""
        n = npe.shape[0] // self.leg.num_hosts
        self.leg.host_exchanges += 1
        mine = npe.to(torch.int64).cpu().numpy()
        peers = self.leg.peer_hosts
        got = sched_mod.host_alltoall(self.leg.sched, {h: mine[h * n:(h + 1) * n].view(np.uint8) for h in peers},
                                      {h: 8 * n for h in self.leg.peer_hosts})
        total = mine[self.leg.host * n:(self.leg.host + 1) * n].copy()
        for h in self.leg.peer_hosts:
            total += got[h].view(np.int64)
        return torch.from_numpy(total.astype(np.int32)).to(self.leg.rt.device)
