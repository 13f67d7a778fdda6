"""The ring kernels' side of internode normal mode's network leg, both paths (:class:`Rings`): the host path's
exchange of records (its headers by :class:`~.exchange.HostExchange`), the rounds of the pack and unpack kernels,
their bounds and errors, and the scheduler's errors given global ranks. The rows' sources come in here and go
straight to the kernels (:mod:`triton_ep.kernels.net`)."""
from __future__ import annotations

import contextlib
import time
from typing import List, Optional, Tuple

import numpy as np
import torch

from ... import scheduler as sched_mod
from ...errors import EPTimeoutError
from ...kernels import flags as F
from ...kernels import net
from ...kernels._util import cdiv, interpreted
from ...runtime.fabric import stall_watchdog
from .records import Streams

Tensor = torch.Tensor


class Rings:
    """The ring rounds of one :class:`~triton_ep.modes.internode.normal.Internode` (``leg``: its scheduler, rings,
    host numbers and counters are read from it at each call)."""

    def __init__(self, leg) -> None:
        self.leg = leg

    @contextlib.contextmanager
    def network(self):
        """One exchange with the RDMA peers: counted and timed (:meth:`stats`), the scheduler's errors given
        global ranks and hosts."""
        t0 = time.perf_counter()
        try:
            yield
        except (sched_mod.ProxyError, EPTimeoutError) as ex:
            if self.leg.sched is not None and self.leg.sched.error is not None:
                self.leg.host_ranks.leave()
            raise self.global_error(ex) from ex
        finally:
            self.leg.network_s += time.perf_counter() - t0
            self.leg.exchanges += 1

    def peer_rank(self, host: Optional[int]) -> Optional[int]:
        """The global rank of this rank's RDMA peer on ``host`` (the scheduler numbers its peers by host)."""
        return None if host is None else self.leg.hosts.ranks(host)[self.leg.local_index]

    def global_error(self, ex: BaseException) -> BaseException:
        """The scheduler's error with global ranks and host numbers in it (its ranks are host indices)."""
        where = f"internode, host {self.leg.host} of {self.leg.num_hosts}"
        if isinstance(ex, sched_mod.RootCauseError):    # (a global rank: the peer's host mate, which it passed on)
            return self.root_error(ex, where)
        if isinstance(ex, sched_mod.PeerGoneError):     # (a rank on host ex.peer: this rank's RDMA peer there)
            gone = self.peer_rank(ex.peer)
            return ex.renamed(self.leg.rt.rank, gone, self.peer_rank(ex.told_by), f"{where}; rank {gone} on host {ex.peer}")
        if isinstance(ex, sched_mod.ProxyError):
            peer = self.peer_rank(ex.peer)
            why = f"{ex.why} ({where}; the peer is rank {peer} on host {ex.peer})" if peer is not None else \
                f"{ex.why} ({where})"
            return type(ex)(self.leg.rt.rank, peer, ex.channel, ex.qp, ex.stage, why)
        peers = [self.peer_rank(p) for p in ex.peers]
        return EPTimeoutError(self.leg.rt.rank, peers, f"{ex.stage} ({where}; waiting for host(s) "
                              f"{', '.join(str(p) for p in ex.peers)})", ex.timeout_s, ex.channel)

    def root_error(self, ex: "sched_mod.RootCauseError", where: str) -> BaseException:
        """:meth:`global_error` of a :class:`~triton_ep.scheduler.RootCauseError`: the RDMA peer on host ``ex.peer``
        failed its network leg because global rank ``ex.root`` (on its host) is gone, or failed on its own, and its
        fault word said so. Returns :class:`~triton_ep.scheduler.PeerGoneError` naming that rank (``failed_rank``,
        ``dead_ranks``) or :class:`~triton_ep.scheduler.ProxyRemoteError` naming it (``culprit``), at the stage this
        rank waited at, with the peer that told it (``told_by``)."""
        me, root, teller = self.leg.rt.rank, ex.root, self.peer_rank(ex.peer)
        where = f"{where}; rank {root} on host {ex.peer}, a host mate of rank {teller}"
        if ex.how == sched_mod.ROOT_GONE:
            return sched_mod.PeerGoneError(me, root, None, None, ex.stage, where, told_by=teller, placed=ex.placed)
        out = sched_mod.ProxyRemoteError(me, root, None, None, ex.stage,
                                         f"rank {root} failed (its own error names why; {where}); rank {teller} "
                                         f"failed its network leg because of it and told this rank")
        out.culprit, out.told_by = root, teller
        return out

    def exchange(self, streams: Optional[Streams], src: Optional[net.Sources], err: Optional[BaseException] = None,
                 skip: Optional[str] = None) -> Tuple[Tensor, List[int], Optional[Tensor]]:
        """One host-path exchange with the RDMA peers: send each host's record stream of ``streams`` (built by the
        kernels from ``src``, the rows' sources) to this rank's RDMA peer there and receive theirs: first a header
        (:meth:`~.exchange.HostExchange.headers`: a status, the record count and the record layout, which must
        agree), then the records (:meth:`move`). A rank that failed (``err``) sends only its header. Where
        this rank or a peer failed, every rank of the exchange raises after the headers, and (with ``skip``,
        the kind of the forwarding leg still to come: ``"dispatch"`` or ``"cached"``) this rank first leaves
        that leg (:meth:`~.host_ranks.HostRanks.skip`: its host's ranks stop at once and tell their own RDMA peers
        in turn).

        Returns: the records received, uint8 ``[n, rec.nbytes]`` on the device, one block per host in host
        order (this host's block is this rank's own stream for it), the blocks' record counts, and (with
        ``streams.npe``) int32 ``[ranks per host * E / R]``: this host's experts' counts summed over the
        sources this rank forwards for (:meth:`~.exchange.HostExchange.expert_counts`).
        Raises: ``err``; what :meth:`~.exchange.HostExchange.headers` raises (a peer's failure, a dead rank, a
        disagreement); the proxy's and the ring kernels' errors (``EPTimeoutError`` naming the peer and the chunk).
        """
        peers = self.leg.peers
        try:
            with self.network():
                counts = peers.headers(streams, err)
                if err is None:
                    npe = None if streams.npe is None else peers.expert_counts(streams.npe)
                    return self.move(streams, src, counts), counts, npe
            raise err
        except BaseException as ex:
            if skip is not None:
                self.leg.host_ranks.skip(skip, ex)
            raise

    def move(self, st: Streams, src: net.Sources, counts: List[int]) -> Tensor:
        """The records of :meth:`exchange`: this host's own block by :func:`net.pack_linear`, the peers'
        through the rings in rounds of ``slots`` chunks per peer (pack, then unpack; the proxy carries them).
        Returns uint8 ``[sum(counts), rec.nbytes]`` on the device."""
        leg = self.leg
        sched, dev, rec = leg.sched, leg.rt.device, st.rec
        rw = rec.nbytes // 4
        starts = np.cumsum([0] + counts)
        out = torch.empty(int(starts[-1]) * rw, dtype=torch.int32, device=dev)
        net.pack_linear(out[int(starts[leg.host]) * rw:], src, st.tokens[leg.host], leg.host)
        S, SW = sched.slots, sched.slot_bytes // 4
        peers = leg.peer_hosts
        tx_words = [st.count(h) * rw for h in range(leg.num_hosts)]
        rx_words = [counts[h] * rw for h in range(leg.num_hosts)]
        ntx = {h: cdiv(tx_words[h], SW) for h in peers}
        nrx = {h: cdiv(rx_words[h], SW) for h in peers}
        tx0, rx0 = sched.reserve(ntx, nrx)
        rounds = max([cdiv(max(ntx[h], nrx[h]), S) for h in peers] + [0])
        if rounds:
            def i64(vals):
                return torch.tensor(vals, dtype=torch.int64, device=dev)
            tok_n = [st.count(h) for h in range(leg.num_hosts)]
            tokens = torch.cat([t.to(dev, torch.int64) for t in st.tokens])
            tok_start = i64(np.cumsum([0] + tok_n)[:-1].tolist())
            n_tx, n_rx = i64(tx_words), i64(rx_words)
            f_tx = i64([tx0.get(h, 0) for h in range(leg.num_hosts)])
            f_rx = i64([rx0.get(h, 0) for h in range(leg.num_hosts)])
            out_start = i64((starts[:-1] * rw).tolist())
            self.rounds(rounds, src, tokens, tok_start, n_tx, f_tx, out, out_start, n_rx, f_rx, wait=True)
        return out.view(torch.uint8).view(int(starts[-1]), rec.nbytes)

    def rounds(self, rounds: int, src: net.Sources, tokens: Tensor, tok_start: Tensor, n_tx: Tensor, f_tx: Tensor,
                out: Tensor, out_start: Tensor, n_rx: Tensor, f_rx: Tensor, wait: bool = False,
                dev: Optional[net.DeviceCounts] = None) -> None:
        """Launch ``rounds`` rounds of the ring kernels (:func:`net.pack_ring`, then :func:`net.unpack_ring`,
        arguments as theirs), under the interpreter with the stall watchdog as their bound; with ``wait``,
        wait for them on the device. Then raise the proxy's error or a ring kernel's recorded one (failing
        the scheduler for good)."""
        sched = self.leg.sched
        S = sched.slots
        common = dict(me_host=self.leg.host, num_hosts=self.leg.num_hosts, slots=S, slot_bytes=sched.slot_bytes,
                      timeout_s=self.leg.rt.timeout_s, dev=dev)
        guard = (stall_watchdog(sched.flags.w, int(F.RING_ABORT), self.leg.rt.timeout_s,
                                self.ring_progress) if interpreted() else contextlib.nullcontext())
        with guard:
            for i in range(rounds):
                net.pack_ring(self.leg._ring_ctrl, self.leg._ring_send, src, tokens, tok_start, n_tx, f_tx, i * S,
                              (i + 1) * S,
                              **common)
                net.unpack_ring(self.leg._ring_ctrl, self.leg._ring_recv, out, out_start, n_rx, f_rx, i * S,
                                (i + 1) * S,
                                **common)
            if wait:
                self.wait_device()
        sched.check()
        self.ring_error()

    def ring_error(self) -> None:
        """Raise a ring kernel's recorded error (a wait that ran out of time or was aborted), failing the
        scheduler for good first (host memory only)."""
        ex = self.leg.sched.flags.error(self.leg.rt.timeout_s)
        if ex is not None:
            self.leg.sched.fail(ex)
            raise ex

    def ring_progress(self) -> int:
        """The sum of the ring's chunk counters (every wait of the ring kernels advances one when it ends)."""
        f = self.leg.sched.flags
        return sum(f.get(a, h) for a in (f.READY, f.SENT, f.TAIL, f.HEAD) for h in self.leg.peer_hosts)

    def wait_device(self) -> None:
        """Wait (bounded; polling, so the proxy threads keep the GIL) for the kernels queued on the device."""
        if self.leg.rt.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record()
        bound = 2 * self.leg.rt.timeout_s + 10.0
        deadline = time.monotonic() + bound
        while not done.query():
            if time.monotonic() > deadline:
                raise EPTimeoutError(self.leg.rt.rank, [], "internode network leg (the ring kernels did not finish)",
                                     bound)
            time.sleep(0.0002)
