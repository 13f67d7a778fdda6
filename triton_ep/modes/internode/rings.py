"""The ring kernels' side of internode normal mode's network leg, both paths (:class:`Rings`): the rounds of
the pack and unpack kernels, their bounds and errors, and the scheduler's errors given global ranks."""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from ... import scheduler as sched_mod
from ...errors import EPTimeoutError
from ...kernels import flags as F
from ...kernels import net
from ...kernels._util import interpreted
from ...runtime.fabric import stall_watchdog

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
