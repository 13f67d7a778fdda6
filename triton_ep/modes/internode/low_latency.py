"""Low-latency mode across hosts (DeepEP's internode low-latency mode): every other rank over RDMA.

A Buffer built with ``low_latency_mode`` whose ranks span several hosts gets a low-latency area of its own
(``num_rdma_bytes``, mapped by the ranks of its host) and a network leg to every other rank of the group
(:mod:`triton_ep.modes.internode.network`: the transport, the RDMA scheduler and its rings, 2 slots per peer,
one per half of the area). The low-latency kernels run as within one host, with the
network leg (:mod:`triton_ep.kernels.ll_net`): records and returned rows for another rank go packed into
that rank's chunk of the send ring, the proxy posts the chunk's WRITEs and then its signal on one QP, and
the receive (or its hook) first unpacks the chunks that arrived into the area. Each token still goes
straight to every rank holding one of its experts (no forwarding). Rows for this rank's own experts stay
in its memory.

The area lives in a buffer the ranks of one host map (CUDA IPC on GPU, POSIX shared memory on CPU): with
``allow_nvlink_for_low_latency_mode`` (DeepEP's default) a peer on the same host is written there directly,
as within one host; without it every other rank goes over RDMA. After an error the next call re-synchronises
the group (:meth:`NetLeg.resync`); a timeout or a failed proxy ends the Buffer's low-latency calls for good.
With ``enable_shrink`` a silent rank on the network is masked (its proxy then drops what it holds for it).
Unmasking one is a collective call (every rank makes it): the group meets as after an error and each pair of
ranks that had masked the other renumbers its rings (:meth:`NetLeg.resync`).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import time
import uuid
from typing import List, Optional, Tuple

import numpy as np
import torch

from ... import scheduler as sched_mod
from ...errors import EPError, EPTimeoutError
from ...kernels import flags as F
from ...kernels._util import env_switch
from ...protocol.ll_area import net_slot_bytes
from ...protocol.records import NET_HEADER_WORDS
from ...runtime import Runtime
from ...runtime import hosts as hosts_mod
from ...protocol import call_card
from ...runtime.fabric import RingFlags, gather_objects, group_store, header_bytes, ipc
from ..low_latency import LowLatency
from .network import Network, agreed_proxy_kind, open_network, proxy_to_exchange


#: seconds ``NetLeg.close`` waits at most for chunks already published to be placed
CLOSE_WAIT_S = 5.0
#: seconds a rank that found a disagreement waits at most for the call card that differs from its own
#: (:meth:`NetLeg.explain_mismatch`)
CARD_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Standing:
    """What a rank brings to a re-synchronisation of low-latency mode across hosts (:meth:`NetLeg.resync`),
    exchanged with every rank of the group."""

    seq: int                # its low-latency call number (the control block's L_SEQ)
    call_base: int          # its signals' call base (``Signals.local_state``)
    ready: List[int]        # [R]: chunks it published to each network peer (RingFlags.READY; 0 for the others)
    tail: List[int]         # [R]: chunks that arrived from each network peer (RingFlags.TAIL; 0 for the others)
    mask: List[int]         # [R]: 1 where it masked the rank
    unmask: List[int]       # the ranks it came to unmask, ascending
    unmasking: bool         # it came to unmask them (else to re-synchronise after an error)

    def purpose(self) -> str:
        """Why it came, as the errors say it."""
        return f"unmask ranks {self.unmask}" if self.unmasking else "re-synchronise after an error"


class NetLeg:
    """What the low-latency kernels take of the network leg: the scheduler's control block ``ring_ctl``
    (int64), the first words of its send and receive rings relative to the low-latency area (``send_dw``,
    ``recv_dw``, int32 words), the words of a slot (``slot_w``) and ``remote`` (int32 ``[R]``: 1 for each rank
    reached over the network). ``network``: the open leg; ``local``: this host's shared buffers (closed with
    the leg); ``group``: the Buffer's process group (the re-synchronisation meets there)."""

    def __init__(self, network: Network, area: torch.Tensor, slot_bytes: int, remote: torch.Tensor,
                 local: Optional[ipc.Comm] = None, group=None, token: str = "") -> None:
        self.network, self.sched, self.ring_ctl, self.group = network, network.sched, network.ring_ctl, group
        #: the receive polls each chunk's arrival word (``Scheduler(arrival_words=True)``) instead of the tail
        self.arrival_words = network.sched.arrival_words
        self.remote, self.local = remote, local
        self.remote_ranks = [r for r, v in enumerate(remote.tolist()) if v]
        base = area.data_ptr()
        deltas = [network.send.data_ptr() - base, network.recv.data_ptr() - base]
        if any(d % 4 for d in deltas):
            raise EPError(f"the rings are not 4-byte aligned with the low-latency area (deltas {deltas})")
        self.send_dw, self.recv_dw = (d // 4 for d in deltas)
        self.slot_bytes, self.slot_w = int(slot_bytes), int(slot_bytes) // 4
        #: the group's key-value store (None where torch has none): ranks that disagree exchange their call cards
        #: there, after the error is recorded (:meth:`explain_mismatch`)
        self.store = group_store(group) if group is not None else None
        #: the keys of those cards: ``<prefix><epoch>/<rank>``, the epoch being the call number the group last
        #: restarted at (:meth:`resync`: equal on every rank); the cards this rank posted, removed after the
        #: next meeting (every rank raised its recorded error before it came)
        self.card_prefix, self.epoch, self._posted = f"triton_ep/llcard/{token}/", 0, []

    def explain_mismatch(self, rt, peer: int) -> Optional[str]:
        """What differs between this rank's latest low-latency call and ``peer``'s, e.g. ``"low_latency_dispatch:
        hidden: rank 0 passed 256, rank 1 passed 128"`` (``Signals.explain_mismatch``; ``rt``: the low-latency
        Runtime, whose call card is in this rank's memory only). A peer on another host cannot read that card,
        and the chunks carry only the call's 64-bit signature: so, on this error path only, this rank posts its
        card in the group's store and reads ``peer``'s (which ``peer`` posts when it raises its side of the same
        disagreement), waiting at most ``min(timeout_s, CARD_WAIT_S)``. Where ``peer``'s card agrees with this
        rank's (``peer`` found the disagreement with a third rank and told this one), the other ranks' cards are
        compared as they come, within the same bound: the rank that differs may post its card after ``peer``.
        ``None`` (the caller's message names the two ranks only): no store, no card that differs came in time, or
        every other rank's came and agrees. Never raises."""
        try:
            me, store = rt.rank, self.store
            if store is None:
                return None
            mine = np.array([int(v) for v in rt.comm.card(me)], dtype=np.int64)
            key = f"{self.card_prefix}{self.epoch}/"
            store.set(key + str(me), mine.tobytes())
            self._posted.append(key + str(me))
            deadline = time.monotonic() + min(rt.timeout_s, CARD_WAIT_S)
            # ``peer``'s card first; where it agrees with this rank's (``peer`` found the disagreement with a third
            # rank and told this one, e.g. a host mate that unpacked the third rank's chunk first), the others' as
            # they come: the rank that differs posts its card when it raises its side, maybe later than ``peer``
            pending = [peer] + [r for r in range(rt.group_size) if r not in (me, peer)]
            while pending:
                for r in list(pending):
                    if not store.check([key + str(r)]):
                        if r == peer:       # (named first: the others' are looked at once it came)
                            break
                        continue
                    pending.remove(r)
                    what = call_card.describe(mine, np.frombuffer(store.get(key + str(r)), dtype=np.int64), me, r)
                    if what is not None:
                        return what
                if not pending or time.monotonic() > deadline:
                    return None
                time.sleep(0.002)
        except Exception:   # noqa: BLE001 - an error path: the caller's plainer message stands
            pass
        return None

    def check(self, rt) -> None:
        """Raise the RDMA proxy's error, if it failed (:meth:`~triton_ep.scheduler.Scheduler.check`), placed at the
        stage this rank's low-latency kernels recorded in ``rt``'s signals (the low-latency Runtime), if any: every
        kernel wait of the leg ends once the proxy failed (its abort word, :func:`triton_ep.kernels.ll_net.abort_word`),
        and its record names where it waited. A :class:`~triton_ep.scheduler.PeerGoneError` so names the gone rank
        and that stage. A proxy process's error, which comes over its channel after its abort word, is waited for by
        the scheduler's own ``check`` (bounded there). Nothing where the proxy did not fail."""
        rec = rt.sig.record()
        sched = self.sched
        if rec is not None and rec.kind == int(F.E_FAILED) and sched.error is None:
            self._look_at_notices()
        sched.waiting = None if rec is None else f"{F.STAGE_NAMES.get(rec.stage, 'unknown')} (round {rec.call})"
        try:
            sched.check()
        finally:
            sched.waiting = None

    def _look_at_notices(self) -> None:
        """A peer's failure word ended a wait of this rank (an error path): look at the peers' proxy fault notices in
        the group's store now (a proxy process's scheduler: :meth:`FaultNotices.look
        <triton_ep.proxy_process.notices.FaultNotices.look>`, bounded), not at the watching thread's next look, up to
        :data:`~triton_ep.proxy_process.notices.FAULT_POLL_S` later. A host mate whose proxy process stopped or died
        posts its notice before its kernels write that word: so this rank names that proxy
        (``ProxyRemoteError``), not a plain failure of the host mate. Never raises."""
        notices = getattr(self.sched, "notices", None)
        if notices is None:
            return
        try:
            notices.look()
        except Exception:   # noqa: BLE001 - an error path: the failure word's error stands
            pass

    def _proxy_failed(self, rt) -> None:
        """Raise the proxy's error where it failed (:meth:`check`), e.g. a peer's proxy fault heard while this rank
        waits at a re-synchronisation meeting; nothing otherwise (one attribute read)."""
        if self.sched.error is not None:
            self.check(rt)

    def post_failure(self, ll: LowLatency, n: int) -> None:
        """This rank rejects low-latency call ``n`` on the host: send every unmasked network peer that call's
        chunk with status ``E_FAILED`` and nothing else, so their receive of that call raises
        ``EPRemoteError`` at once (bounded wait for each send slot; raises ``EPTimeoutError`` or the proxy's
        error). Reads the chunk offsets and masks from the device (an error path)."""
        sched, R = self.sched, ll.rt.group_size
        tx = ll.ctl[F.off_ll_tx.host(R):F.off_ll_tx.host(R) + R].tolist()
        mask = ll.ctl[F.off_ll_mask.host(R):F.off_ll_mask.host(R) + R].tolist()
        for p in self.remote_ranks:
            if mask[p]:
                continue
            k = n - 1 + tx[p]
            sched.wait_counter(RingFlags.SENT, p, k - 1, "low-latency failure notice: free send slot")
            sched.send_view(p, k)[:NET_HEADER_WORDS * 4].view(np.int64)[:] = (n, 0, int(F.E_FAILED), 0)
            sched.publish(p, k, NET_HEADER_WORDS * 4)

    def resync(self, ll: LowLatency, unmask=None) -> None:
        """After an error that did not end the Buffer (a rejected call, a mismatch, bad ids), or to unmask ranks
        (``unmask``: the ranks every rank unmasks, a collective call): meet every rank of the group (a bounded
        exchange through its store), drain the chunks still on their way to this rank, and restart the call
        numbers above the highest any rank reached, each peer's chunk numbers going on from where its ring stands
        (``TXOFF``/``RXOFF``). Hooks still pending are dropped. Every rank's device work must be finished (the
        caller waited for it).

        A pair of ranks of which either masked the other has dropped chunks (counted as placed on the sending
        side, never arrived on the other): nothing is drained between them. When one of the two is in
        ``unmask``, both stop posting to each other (their proxies drop what is still held back), wait until no
        chunk is in flight between them, renumber their rings (:meth:`Scheduler.rebase`) to numbers worked out
        alike on both sides from the exchanged counters, and unmask each other; otherwise they stay masked. An
        unmask ends with a second exchange, so no rank sends before every rank has renumbered.

        Raises:
            EPTimeoutError: a rank did not come to the meeting, or a peer's chunks did not arrive or complete,
                within ``timeout_s`` (the Buffer is then unusable); the proxy's error.
            ValueError: on every rank, when the ranks came with different ``unmask`` sets (or some came to
                re-synchronise after an error): nothing was changed.

        An error of the first exchange (a rank that did not come: dead, or raising its own error, e.g. its proxy
        failed) carries ``_ep_nothing_changed``: no state was touched.
        """
        rt, me = ll.rt, ll.rt.rank
        mine = self._standing(ll, unmask)
        every = self._meet(rt, mine)

        def masked_pair(a: int, b: int) -> bool:
            return bool(every[a].mask[b] or every[b].mask[a])
        renumber = [p for p in self.remote_ranks if masked_pair(me, p) and (p in mine.unmask or me in mine.unmask)]
        # calls up to top are done; top + 1 is left unused: the failure words posted before the meeting name calls
        # up to it (_restart), so the numbers go on from top + 2
        top = max(e.seq for e in every) + 1
        # nothing is drained from a peer either side masked
        self._drain(rt, {p: every[p].ready[me] for p in self.remote_ranks if not masked_pair(me, p)})
        next_tx, next_rx = self._renumber(every, mine, renumber, me)
        self._restart(ll, top, next_tx, next_rx, renumber)
        rt.sig.resync(max(e.call_base for e in every) + 1)
        ll.pending.clear()
        # (every rank raised its recorded error before this meeting: the cards it posted were read)
        self.epoch = top
        self._forget_cards()
        if mine.unmasking:
            # every rank renumbered before any sends again: a peer's first chunk after the renumbering must not
            # arrive here before this rank's own renumbering (which would drop it)
            gather_objects(self.group, None, rt.timeout_s,
                           f"low-latency across hosts: {mine.purpose()}, rings renumbered",
                           check=functools.partial(self._proxy_failed, rt))

    def _standing(self, ll: LowLatency, unmask) -> "Standing":
        """What this rank brings to a re-synchronisation: its counters, masks and the ranks it came to unmask."""
        rt, sched, ctl, R = ll.rt, self.sched, ll.ctl, ll.rt.group_size
        remote = set(self.remote_ranks)
        ready = [sched.flags.get(RingFlags.READY, p) if p in remote else 0 for p in range(R)]
        tail = [sched.flags.get(RingFlags.TAIL, p) if p in remote else 0 for p in range(R)]
        mask = [int(v) for v in ctl[F.off_ll_mask.host(R):F.off_ll_mask.host(R) + R].tolist()]
        return Standing(int(ctl[int(F.L_SEQ)].item()), rt.sig.local_state()[0], ready, tail, mask,
                        sorted(int(r) for r in (unmask or ())), unmask is not None)

    def _meet(self, rt, mine: "Standing") -> list:
        """Meet every rank of the group (a bounded exchange through its store) and return every rank's
        :class:`Standing`, in rank order.

        Raises:
            what :func:`gather_objects` raises, marked ``_ep_nothing_changed`` (no state was touched); the proxy's
                error as soon as it fails while this rank waits there (e.g. a peer's proxy process stopped, told
                through the group's store: that peer will not come), not after ``timeout_s``.
            ValueError: a rank came for another purpose (other ``unmask`` ranks, or to re-synchronise).
        """
        try:
            every = gather_objects(self.group, mine, rt.timeout_s, f"low-latency across hosts: {mine.purpose()}",
                                   check=functools.partial(self._proxy_failed, rt))
        except Exception as ex:
            if self.sched.error is None:        # (a failed proxy ends the low-latency calls whatever was touched)
                ex._ep_nothing_changed = True   # (the caller may keep the Buffer: no state was touched)
            raise
        odd = [r for r, e in enumerate(every) if (e.unmask, e.unmasking) != (mine.unmask, mine.unmasking)]
        if odd:
            raise ValueError(f"rank {rt.rank}: the ranks met to change the low-latency masks differently: this rank "
                             f"came to {mine.purpose()}, rank {odd[0]} to {every[odd[0]].purpose()}; every rank must "
                             f"make the same unmask call (low_latency_update_mask_buffer(rank, False) or "
                             f"low_latency_clean_mask_buffer())")
        return every

    def _drain(self, rt, want: dict) -> None:
        """Consume what each network peer ``p`` sent this rank, as it arrives (freeing slots lets its proxy post the
        rest), until its chunk count ``want[p]`` is reached. Raises ``EPTimeoutError`` after ``timeout_s``."""
        sched = self.sched
        deadline = time.monotonic() + rt.timeout_s
        while True:
            sched.check()
            late = {p: w for p, w in want.items() if sched.flags.get(RingFlags.TAIL, p) < w}
            for p in want:
                sched.consume(p, min(sched.flags.get(RingFlags.TAIL, p), want[p]))
            if not late:
                return
            if time.monotonic() > deadline:
                p = next(iter(late))
                raise EPTimeoutError(rt.rank, p, "low-latency re-synchronisation: chunks still on their way",
                                     rt.timeout_s)
            time.sleep(0.0005)

    def _renumber(self, every: list, mine: "Standing", renumber: list, me: int) -> Tuple[list, list]:
        """The chunk numbers each peer's rings go on from (``[R]`` to send, ``[R]`` to receive): where they stand,
        except for the ``renumber`` peers, which stop posting (their proxies drop what is held back), wait until no
        chunk is in flight and renumber (:meth:`Scheduler.rebase`) to what either side counted, whichever is ahead
        (the same numbers on both sides)."""
        sched = self.sched
        next_tx = list(mine.ready)
        next_rx = [e.ready[me] for e in every]
        for p in renumber:
            sched.flags.mask(p)     # its proxy drops what is still held back for p (no credit): nothing more goes
            sched.wait_quiet(p, "low-latency unmask: chunks posted before the mask")
            next_tx[p] = max(mine.ready[p], every[p].tail[me])
            next_rx[p] = max(every[p].ready[me], mine.tail[p])
            sched.rebase(p, next_tx[p], next_rx[p])
        return next_tx, next_rx

    @staticmethod
    def _restart(ll: LowLatency, top: int, next_tx: list, next_rx: list, renumber: list) -> None:
        """Restart the low-latency control block at call ``top + 1`` (calls up to ``top`` done): each peer's chunk
        offsets (``TXOFF`` / ``RXOFF``) from ``next_tx`` / ``next_rx``, the ``renumber`` peers unmasked.

        The failure words (``LFAILED``) are left as they are, as within one host
        (:meth:`~triton_ep.modes.low_latency.state.LowLatencyState.resync_apply`): a host mate that leaves the meeting
        first may already have written the failure of its next call here (it rejected its arguments at once), and
        clearing the words would lose it (this rank would wait out ``timeout_s`` for that host mate). The caller
        passes a ``top`` one above the highest call any rank reached: the words posted before the meeting name calls up
        to that one, so none matches a call after the restart."""
        ctl, R = ll.ctl, ll.rt.group_size
        with torch.inference_mode():
            tx = [next_tx[p] - top for p in range(R)]
            rx = [next_rx[p] - top for p in range(R)]
            ctl[F.off_ll_tx.host(R):F.off_ll_tx.host(R) + R].copy_(torch.tensor(tx, dtype=torch.int64, device=ctl.device))
            ctl[F.off_ll_rx.host(R):F.off_ll_rx.host(R) + R].copy_(torch.tensor(rx, dtype=torch.int64, device=ctl.device))
            # L_SEQ, L_DONE, CONS[0..1], UNPACKED[0..1], PEND[0..1] (as CONS: nothing left to release): call top + 1
            # comes next, calls up to top are done
            unpacked = [top if top % 2 == h else top - 1 for h in (0, 1)]
            ctl[:8].copy_(torch.tensor([top, 0, top, top] + unpacked + [top, top], dtype=torch.int64, device=ctl.device))
            for p in renumber:
                ctl[F.off_ll_mask.host(R) + p].fill_(0)
                ctl[F.off_ll_gaveup.host(R) + p].fill_(0)

    def _forget_cards(self) -> None:
        """Remove the call cards this rank posted (:meth:`explain_mismatch`) from the group's store."""
        for key in self._posted:
            try:
                self.store.delete_key(key)
            except Exception:   # noqa: BLE001 - a store without delete: the key stays
                pass
        self._posted.clear()

    def close(self, gone: Optional[int] = None) -> None:
        """Let the proxy place the chunks already published (a failure notice a rank posted just before
        destroying its Buffer must still reach the peers; bounded by ``CLOSE_WAIT_S`` or ``timeout_s``, none
        after a proxy error: a peer that closed first never takes them), then close the leg. ``gone``: a rank
        whose process this rank knows to be gone; unless the proxy failed already, it is failed with
        :class:`~triton_ep.scheduler.PeerGoneError` naming that rank (after the wait: the peers still take this
        rank's chunks), so its fault word tells every RDMA peer before this rank's QPs go."""
        sched = self.sched
        deadline = time.monotonic() + min(sched.timeout_s, CLOSE_WAIT_S)
        while sched.error is None and time.monotonic() < deadline and any(
                sched.flags.get(RingFlags.SENT, p) < sched.flags.get(RingFlags.READY, p) for p in sched.peers):
            time.sleep(0.001)
        if gone is not None and sched.error is None:
            sched.fail(sched_mod.PeerGoneError(
                sched.rank, gone, None, None, "destroy", "its process is gone (this rank knew it from its host's "
                "liveness lock or its own waits) and this rank destroyed its Buffer"))
        self.ring_ctl = None        # (a view of the rings: the proxy's mapping is closed with it, Network.close)
        self.network.close()

    def drop_views(self) -> None:
        """Forget the views of the rings and of this host's shared buffers (after :meth:`close`): an object the
        caller still holds that reaches this leg keeps none of that memory mapped."""
        self.ring_ctl = self.local = None
        self.network.drop_views()


def arrival_words_switch() -> bool:
    """``TRITON_EP_LL_ARRIVAL_WORDS`` (:func:`~triton_ep.kernels._util.env_switch`; unset: off): whether the
    network leg signals each chunk with an arrival word the receiving kernel polls (an RDMA WRITE after the chunk
    on its QP) instead of a WRITE_WITH_IMM whose receive completion the receiving proxy turns into the tail.
    Raises ``ValueError`` for a value that is no switch."""
    return bool(env_switch("TRITON_EP_LL_ARRIVAL_WORDS"))


class LowLatencyAcrossHosts(LowLatency):
    """Low-latency mode of a Buffer across hosts (collective over ``rt.group``): :class:`LowLatency` over an area
    of its own that this host's ranks map, with a network leg (:class:`NetLeg`) to every rank it reaches over RDMA.

    Args:
        rt: the Buffer's :class:`~triton_ep.runtime.across_hosts.HostsRuntime`.
        area_bytes: ``num_rdma_bytes`` rounded up to 4 KiB: the area, in a buffer the ranks of this host map
            (CUDA IPC on GPU, POSIX shared memory on CPU); the network leg takes about twice that in
            registered host memory (2 slots of :func:`~triton_ep.protocol.ll_area.net_slot_bytes` per peer
            and direction).
        num_qps_per_rank: RC QPs to each peer (placed over ports and ECMP paths by the topology plan).
        shrink: ``enable_shrink``: a peer that does not answer within ``timeout_s`` is masked.
        allow_nvlink: peers on this rank's host are reached through the shared buffer (NVLink / IPC, DeepEP's
            ``allow_nvlink_for_low_latency_mode``); else over RDMA as the other hosts' ranks.
        delays: the emulated fabric's ``(reorder_s, skew_s)`` as the normal-mode set-up agreed on them
            (``Internode.delays``); ``None``: read from the environment.
    Raises:
        ValueError: ``num_qps_per_rank`` not an int >= 1; ranks disagree on it, on ``enable_shrink``,
            ``allow_nvlink_for_low_latency_mode`` or ``TRITON_EP_LL_ARRIVAL_WORDS`` (on every rank; ``num_rdma_bytes``
            is checked before, by :class:`~triton_ep.modes.internode.normal.Internode`); ``TRITON_EP_LL_ARRIVAL_WORDS``
            is no switch on some rank (on every rank, naming that rank).
        EPTimeoutError / EPRemoteError: a rank did not take part in the set-up within ``rt.timeout_s``.
    """

    def __init__(self, rt, area_bytes: int, num_qps_per_rank: int, shrink: bool, allow_nvlink: bool = True,
                 delays: Optional[tuple] = None) -> None:
        me, R, dev, hosts = rt.rank, rt.group_size, rt.device, rt.hosts
        token, qps, arrival, proxy = _agree(rt, num_qps_per_rank, allow_nvlink, shrink)
        names = [f"ll{token}_{r}" for r in range(R)]
        # Each rank's [signal header of the whole group | area], in a buffer this host's ranks map: the kernels
        # see a group of R ranks in which a peer on another host (or, without allow_nvlink, any peer) aliases this
        # rank's own buffer and is reached over the network leg instead.
        hb = header_bytes(R)
        local = ipc.open_group(rt.local_group, hb + int(area_bytes), dev, rt.timeout_s)
        own = network = None
        try:
            same = [hosts.host_of[r] == hosts.host_of[me] and (allow_nvlink or r == me) for r in range(R)]
            bufs = [local.peers[hosts.local_index(r)] if same[r] else local.data for r in range(R)]
            with torch.inference_mode(False):
                local.data[:hb].zero_()     # the group's signal header starts at zero (peers write after the exchange)
                ctrl = torch.zeros(ipc.ctrl_words(R, ipc.SLOT_WORDS) * 8, dtype=torch.uint8, device="cpu")
                remote = torch.tensor([0 if s else 1 for s in same], dtype=torch.int32, device=dev)
            comm = ipc.Comm(me, R, dev, bufs, ctrl, rt.timeout_s, ipc.SLOT_WORDS,
                            ranks_on_device=local.ranks_on_device, concurrent=True)
            own = Runtime(comm, rt.timeout_s, rt.uid, None, 0, int(area_bytes), hosts, rt.rdma_transport)
            super().__init__(own, 0, int(area_bytes), shrink)   # zeroes its control block before the exchange below
            slot = net_slot_bytes(area_bytes, R)
            network = open_network(rt.rdma_transport, rt.group, me, R, token=token, names=names, name=names[me],
                                   num_qps_per_peer=qps, slots=2, slot_bytes=slot, timeout_s=rt.timeout_s,
                                   device=dev, proxy=proxy, peers=[r for r in range(R) if not same[r]],   # none on NVLink
                                   arrival_words=arrival, delays=delays)
            self.net = NetLeg(network, self.area, slot, remote, local, rt.group, token)
            # a peer the proxy finds gone (scheduler.PeerGoneError: its QPs stopped acknowledging) ends the kernels'
            # waits for it as a dead peer of this host does (its DEAD word; the leg's ranks are the group's)
            network.sched.on_gone = own.sig.dead_marker()
            watch_host(own, local, list(hosts.ranks(hosts.host_of[me])))
            own.sig.explain_mismatch = functools.partial(self.net.explain_mismatch, own)
        except BaseException:
            try:
                if network is not None:
                    network.close()
            finally:
                if own is not None:
                    own.close()
                local.close()
            raise

    def close(self) -> None:
        """Release the network leg (the proxy, QPs, MRs, CQs and PD), then the area. A rank that knows of a dead rank
        (:func:`known_dead`) and whose proxy has not failed first fails it with
        :class:`~triton_ep.scheduler.PeerGoneError` naming that rank (not with ``enable_shrink``, where a dead rank is
        masked): its fault word tells every RDMA peer before this rank's QPs go, so a peer still waiting raises
        naming the dead rank, not this one (whose QPs its probes would find gone next)."""
        net = self.net
        if net is None:
            return
        try:
            dead = known_dead(self.rt) if not self.shrink and self.rt.comm is not None else []
            net.close(dead[0] if dead else None)
        finally:
            try:
                self.rt.close()
            finally:
                try:
                    if net.local is not None:
                        net.local.close()
                finally:
                    # (a hook the caller keeps reaches this object: it must keep none of the memory mapped)
                    net.drop_views()
                    self.drop_views()


def watch_host(own: Runtime, local: ipc.Comm, ranks: List[int]) -> None:
    """Within this host, see a dead peer as a Buffer of one host does: ``local`` (this host's shared buffers, opened
    over the host's process group) holds a liveness lock per rank of the host (:mod:`triton_ep.transport.liveness`,
    numbered by local index; ``ranks``: the global rank of each). Its watcher thread sets a dead rank's ``DEAD`` word
    in ``own``'s signals (the low-latency runtime, numbered by global rank), so every kernel wait for it ends with
    ``E_GONE`` within about 0.1 s and raises ``EPRemoteError`` naming it (whether the rank is reached through the
    shared buffer or over RDMA: its RDMA peers' probes take longer); the error names the dead rank from those words,
    or from the locks looked at then (``own.sig.dead_peers``). The watcher stops when ``local`` closes. Nothing happens where the platform has no such locks (``local.liveness``
    ``None``): a dead rank of this host is then seen by its peers' probes, or at ``timeout_s``.

    The watcher does not fail the network leg's scheduler: its proxy would stop receiving, and this rank's call would
    fail for want of the chunks of live peers still on their way (every wait of the leg ends once the proxy failed:
    its abort word). :meth:`LowLatencyAcrossHosts.close` tells the RDMA peers instead."""
    live = local.liveness
    if live is None:
        return
    mark = own.sig.dead_marker()
    own.sig.dead_peers = lambda: {ranks[p]: why for p, why in live.dead_peers().items()}
    live.watch(lambda p: mark(ranks[p]))


def known_dead(rt: Runtime) -> List[int]:
    """The ranks whose process this rank knows to be gone: their ``DEAD`` words (set by this host's liveness watcher
    or by the proxy's :class:`~triton_ep.scheduler.PeerGoneError`), else this host's locks looked at now."""
    words = rt.sig.host[int(F.H_DEAD):int(F.H_DEAD) + rt.group_size].tolist()
    dead = [r for r, w in enumerate(words) if w]
    if not dead and rt.sig.dead_peers is not None:
        dead = sorted(rt.sig.dead_peers())
    return dead


def _agree(rt, num_qps_per_rank, allow_nvlink: bool, shrink: bool) -> Tuple[str, int, bool, str]:
    """The set-up exchange (collective over ``rt.group``): every rank's fabric token, ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``enable_shrink``, ``TRITON_EP_LL_ARRIVAL_WORDS`` and ``TRITON_EP_PROXY``,
    checked equal after the exchange (a bad value raises on every rank alike). Returns the token, the QPs, the
    switch and where the RDMA proxy runs."""
    me = rt.rank
    try:                # (a bad value is raised after the exchange, on every rank alike)
        arrival = arrival_words_switch()
    except ValueError as ex:
        arrival = f"rank {me}: {ex}"
    try:                # (an int, numpy's included; a bool or anything else is refused below, on every rank)
        qps = repr(num_qps_per_rank) if isinstance(num_qps_per_rank, bool) else operator.index(num_qps_per_rank)
    except TypeError:
        qps = repr(num_qps_per_rank)
    # (num_rdma_bytes, with low_latency_mode, was checked equal on every rank by the normal-mode set-up)
    every = gather_objects(rt.group, (uuid.uuid4().hex[:12], qps, bool(allow_nvlink), bool(shrink), arrival,
                                      proxy_to_exchange(me)), rt.timeout_s, "internode low-latency: fabric token")
    proxy = agreed_proxy_kind([e[5] for e in every])      # (every rank of the group, before any leg opens)
    hosts_mod.agreed("num_qps_per_rank (low-latency mode across hosts)", [e[1] for e in every])
    if not isinstance(qps, int) or qps < 1:     # (checked after the exchange: every rank raises it alike)
        raise ValueError(f"num_qps_per_rank must be an int >= 1 for low-latency mode across hosts (RC QPs to each "
                         f"peer); got {num_qps_per_rank!r}")
    hosts_mod.agreed("allow_nvlink_for_low_latency_mode (low-latency mode across hosts)", [e[2] for e in every])
    hosts_mod.agreed("enable_shrink (low-latency mode across hosts)", [e[3] for e in every])
    hosts_mod.first_error([e[4] for e in every])
    hosts_mod.agreed("TRITON_EP_LL_ARRIVAL_WORDS (low-latency mode across hosts)", [e[4] for e in every])
    return every[0][0], qps, arrival, proxy
