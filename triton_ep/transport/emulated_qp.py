"""The RC queue pair of the emulated fabric (:mod:`triton_ep.transport.emulated`): its state machine and RTR
checks, the requester (work queue entries, records, completions) and the responder (placement, RNR, remote
errors), as the verbs spec describes them."""
from __future__ import annotations

import collections
import copy
import ctypes
import errno as _errno
import struct
import threading
import time
from typing import List, Optional, Tuple

from triton_ep.transport import topology
from triton_ep.transport.emulated_api import WC, E, PyverbsRDMAError, QPAttr, QPInitAttr, RecvWR, SendWR, _WQE
from triton_ep.transport.emulated_device import PD
from triton_ep.transport.emulated_engine import _counting_nic_cpu
from triton_ep.transport.emulated_ring import _ACK, _F_LAST, _HDR, _REQ, _Ring, _created_rings, _pack
from triton_ep.transport.emulated_spec import is_link_local, mtu_code


_TRANSITIONS = {E.IBV_QPS_RESET: {E.IBV_QPS_INIT}, E.IBV_QPS_INIT: {E.IBV_QPS_INIT, E.IBV_QPS_RTR},
                E.IBV_QPS_RTR: {E.IBV_QPS_RTS}, E.IBV_QPS_RTS: {E.IBV_QPS_RTS}}


def _rnr_delay_s(timer: int) -> float:
    """Seconds of the IB ``min_rnr_timer`` encoding (0 means 655.36 ms; 1..31 grow from 0.01 ms)."""
    table = [655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28,
             1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84,
             245.76, 327.68, 491.52]
    return table[timer & 31] / 1000.0


class QP:
    """An RC ``ibv_qp``: state machine RESET -> INIT -> RTR -> RTS (any -> ERR/RESET), post_send, post_recv.

    After RTR, ``ah`` is a copy of the ``AHAttr`` it was given (SL, traffic class, flow label, GIDs, as an HCA
    keeps them) and ``dst`` the (device index, port) its packets reach, None when they reach nothing.
    """

    def __init__(self, pd: PD, init_attr: QPInitAttr, qp_attr: Optional[QPAttr] = None) -> None:
        if init_attr.qp_type != E.IBV_QPT_RC:
            raise PyverbsRDMAError("Failed to create QP: only RC is emulated", _errno.EOPNOTSUPP)
        if init_attr.send_cq is None or init_attr.recv_cq is None:
            raise PyverbsRDMAError("Failed to create QP: missing CQ", _errno.EINVAL)
        self.pd, self.ctx = pd, pd.ctx
        self.engine = eng = pd.ctx.engine
        self.scq, self.rcq = init_attr.send_cq, init_attr.recv_cq
        self.cap = init_attr.cap
        self.sq_sig_all = init_attr.sq_sig_all
        self.qp_num = eng.new_qpn(self.ctx.dev_index)
        self.qp_type = E.IBV_QPT_RC
        self.state = E.IBV_QPS_RESET
        self.port, self.access, self.mtu = 1, 0, E.IBV_MTU_1024
        self.dest_qpn, self.ah, self.dst = 0, None, None
        self.min_rnr_timer, self.rnr_retry, self.retry_cnt, self.timeout = 0, 0, 0, 0
        self.forced_sport, self.lag_port = 0, 0
        self._route: Optional[tuple] = None
        self.seq = 0
        self.outstanding: "collections.OrderedDict[int, dict]" = collections.OrderedDict()
        self.sq: collections.deque = collections.deque()   # seqs occupying send-queue slots
        #: work queue entries posted and not yet executed by the progress thread (:meth:`post_send`)
        self.doorbell: "collections.deque[_WQE]" = collections.deque()
        self.rq: collections.deque = collections.deque()   # posted receive wr_ids
        self.pending: collections.deque = collections.deque()   # [hold-until, request record]
        self.acks: collections.deque = collections.deque()
        self.early_since: Optional[float] = None
        self.last_hold = 0.0
        self.rnr: Optional[dict] = None
        self.lost_since: Optional[float] = None   # post time of the oldest request to an unreachable destination
        #: the destination QP is gone (its process ended, or it was destroyed: :meth:`_Engine.look_at_peer`), and
        #: when the progress thread looks at it next
        self.peer_gone, self.peer_look_at = False, 0.0
        self.async_error: Optional[str] = None
        self.send_lock = threading.Lock()
        self.ring = _Ring(eng.path(self.qp_num), eng.fabric.spec.ring_bytes, create=True)
        _created_rings.add(self.ring.path)
        with eng.lock:
            eng.qps[self.qp_num] = self
        eng.start()          # the progress thread runs while this process has QPs

    @property
    def qp_state(self) -> int:
        """Current state (``IBV_QPS_*``)."""
        return self.state

    # ---- state transitions
    def _move(self, attr: QPAttr, new: int) -> None:
        if new not in _TRANSITIONS.get(self.state, ()):
            raise PyverbsRDMAError(f"Failed to modify QP state to {new} from {self.state}", _errno.EINVAL)
        if new == E.IBV_QPS_INIT:
            ports = self.ctx.spec.ports
            if not 1 <= attr.port_num <= len(ports):
                raise PyverbsRDMAError(f"Failed to modify QP to INIT: bad port {attr.port_num}", _errno.EINVAL)
            self.port, self.access = attr.port_num, attr.qp_access_flags
        elif new == E.IBV_QPS_RTR:
            self._rtr(attr)
        elif new == E.IBV_QPS_RTS:
            self.retry_cnt, self.rnr_retry, self.timeout = attr.retry_cnt, attr.rnr_retry, attr.timeout
        self.state = new

    def _rtr(self, attr: QPAttr) -> None:
        """Check and keep the RTR attributes (``ibv_modify_qp`` to RTR; the checks of the verbs spec, 11.2.5).

        Raises ``PyverbsRDMAError``: EINVAL for no address or destination QPN, a bad ``sgid_index``, an SL
        outside 0..15 or a traffic class outside 0..255, or a path MTU that is not an ``IBV_MTU_*`` code or is
        above the local or the remote port's active MTU; EHOSTUNREACH for a routable destination GID (or LID)
        that no port owns (the kernel's neighbour resolution fails at RTR).  A link-local destination is not
        resolved (the kernel derives its MAC from the GID), so an unreachable one -- on another L2 segment, or
        nowhere -- passes RTR and the first send ends in ``IBV_WC_RETRY_EXC_ERR`` (:meth:`_lost`).
        """
        ah = attr.ah_attr
        if ah is None or not attr.dest_qp_num:
            raise PyverbsRDMAError("Failed to modify QP to RTR: no address or dest QPN", _errno.EINVAL)
        own = self.ctx._gids(self.port)
        if ah.is_global and not 0 <= ah.sgid_index < len(own):
            raise PyverbsRDMAError(f"Failed to modify QP to RTR: bad sgid_index {ah.sgid_index}", _errno.EINVAL)
        if not 0 <= ah.sl <= 15 or (ah.is_global and not 0 <= ah.traffic_class <= 255):
            raise PyverbsRDMAError(f"Failed to modify QP to RTR: bad sl {ah.sl} or traffic_class "
                                   f"{ah.traffic_class}", _errno.EINVAL)
        fab, src = self.engine.fabric, (self.ctx.dev_index, self.port)
        sgid, dgid = (own[ah.sgid_index][0], ah.dgid) if ah.is_global else ("", "")
        ps = self.ctx.spec.ports[self.port - 1]
        try:
            dst = fab.resolve(dgid, ah.dlid, src, sgid)
        except KeyError:
            if not (ps.link_layer == "Ethernet" and is_link_local(dgid)):
                raise PyverbsRDMAError("Failed to modify QP to RTR: destination unreachable",
                                       _errno.EHOSTUNREACH) from None
            dst = None
        if dst is not None and not (fab.reaches(src, sgid, dst, dgid) and (attr.dest_qp_num >> 12) - 1 == dst[0]):
            dst = None        # another segment, or a QPN the port at that GID does not have: packets are lost
        limit = min([mtu_code(ps)] + ([mtu_code(fab.spec.devices[dst[0]].ports[dst[1] - 1])] if dst else []))
        if not E.IBV_MTU_256 <= attr.path_mtu <= limit:
            raise PyverbsRDMAError(f"Failed to modify QP to RTR: path_mtu {attr.path_mtu} above the active MTU "
                                   f"({limit}) of this or the remote port", _errno.EINVAL)
        self.ah, self.dst, self.dest_qpn = copy.copy(ah), dst, attr.dest_qp_num
        self.mtu, self.min_rnr_timer, self.lost_since = attr.path_mtu, attr.min_rnr_timer, None
        self.peer_gone, self.peer_look_at = False, 0.0
        if dst is not None:
            try:        # map the peer's inbound ring now, so that its owner may unlink the file (Fabric.unlink_rings)
                self.engine.out_ring(self.dest_qpn)
            except OSError:
                pass    # not created yet: mapped on the first send, as before

    def retry_time_s(self) -> float:
        """Seconds before a request that is never acknowledged fails: (``retry_cnt`` + 1) local ACK timeouts of
        4.096 us * 2 ** ``timeout`` (IB encoding; ``timeout`` 0 means wait forever: ``inf``)."""
        return float("inf") if not self.timeout else (self.retry_cnt + 1) * 4.096e-6 * (1 << self.timeout)

    def _lost(self, now: float) -> None:
        """Called by the progress thread: once the oldest request to an unreachable destination has waited
        :meth:`retry_time_s`, it completes with ``IBV_WC_RETRY_EXC_ERR`` and the QP moves to ERR."""
        if self.lost_since is not None and self.outstanding and now >= self.lost_since + self.retry_time_s():
            self.lost_since = None
            self._error(next(iter(self.outstanding)), E.IBV_WC_RETRY_EXC_ERR)

    def to_init(self, attr: QPAttr) -> None:
        """RESET -> INIT: port, access flags (remote write / atomic allowed as responder)."""
        self._move(attr, E.IBV_QPS_INIT)

    def to_rtr(self, attr: QPAttr) -> None:
        """(RESET ->) INIT -> RTR: destination address (GID/LID), dest QPN, MTU, min RNR timer."""
        if self.state == E.IBV_QPS_RESET:
            self.to_init(attr)
        self._move(attr, E.IBV_QPS_RTR)

    def to_rts(self, attr: QPAttr) -> None:
        """(-> RTR) -> RTS: retry counts and timeout; the QP may now send."""
        if self.state in (E.IBV_QPS_RESET, E.IBV_QPS_INIT):
            self.to_rtr(attr)
        self._move(attr, E.IBV_QPS_RTS)

    def modify(self, attr: QPAttr, comp_mask: int = 0) -> None:
        """Only moves to ERR or RESET are emulated here (the backend uses to_init/to_rtr/to_rts)."""
        if attr.qp_state == E.IBV_QPS_ERR:
            with self.engine.lock:
                self._to_error()
        elif attr.qp_state == E.IBV_QPS_RESET:
            with self.send_lock, self.engine.lock:     # (the order _post_send takes them in; _retire: send lock)
                self.state, self.lost_since = E.IBV_QPS_RESET, None
                for q in (self.outstanding, self.sq, self.doorbell, self.rq, self.pending, self.acks):
                    q.clear()
        else:
            self._move(attr, attr.qp_state)

    # ---- requester
    def _path_resources(self) -> Tuple[list, tuple]:
        """Rate-model resources and (UDP sport, path) of this QP; cached until the route changes."""
        key = (self.forced_sport, self.lag_port, self.dest_qpn, id(self.ah))
        if self._route is None or self._route[0] != key:
            self._route = (key, self._compute_route())
        return self._route[1]

    def _compute_route(self) -> Tuple[list, tuple]:
        fab = self.engine.fabric
        ps = self.ctx.spec.ports[self.port - 1]
        src_gid = self.ctx._gids(self.port)[self.ah.sgid_index if self.ah.is_global else 0][0]
        dst_gid = self.ah.dgid if self.ah.is_global else ""
        sport = topology.effective_udp_sport(self.ah.flow_label if self.ah.is_global else 0,
                                             self.qp_num, self.dest_qpn, self.forced_sport)
        path = topology.emulator_path_hash(src_gid, dst_gid, sport, fab.spec.n_paths)
        lag = self.lag_port or ((self.qp_num % ps.lag_ports) + 1 if ps.lag_ports else 0)
        dd, dp = self.dst
        dps = fab.spec.devices[dd].ports[dp - 1]
        res = [(("tx", self.ctx.dev_index, self.port, lag), ps.speed_gbps * 1e9 / 8),
               # links are full duplex: a path carries each direction at its own rate
               (("path", path, self.ctx.dev_index < dd), fab.spec.path_gbps * 1e9 / 8),
               (("rx", dd, dp), dps.speed_gbps * max(1, dps.lag_ports) * 1e9 / 8)]
        return res, (sport, path)

    def flow(self) -> Tuple[int, int]:
        """(UDP source port, fabric path) this QP's packets use (after RTR)."""
        return self._path_resources()[1]

    def post_send(self, wr: SendWR, bad_wr=None) -> None:
        """Post a chain of send WRs (``next_wr``): a doorbell, as on a NIC. Each request takes a send-queue slot and
        its fields (and its SGEs' addresses, lengths and keys) are copied into a work queue entry, as a provider
        library writes a WQE; the progress thread then executes it, as the HCA does after the doorbell: it checks the
        keys, reads the payload (so, as on a NIC, the source memory must stay as it is until the request completes),
        charges the rate model and sends the records. Raises ENOMEM on a full send queue (the requests before the
        one that did not fit stay posted), EINVAL before RTS. Its CPU time counts in :func:`nic_cpu_s`."""
        _counting_nic_cpu(self._post_send, wr)

    def _post_send(self, wr: SendWR) -> None:
        if self.state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
            raise PyverbsRDMAError(f"Failed to post send: QP {self.qp_num} not in RTS", _errno.EINVAL)
        if self.state == E.IBV_QPS_ERR:
            with self.send_lock, self.engine.lock:      # (in ERR the requests flush at once: nothing to execute)
                self._flush_posted(wr)
            return
        full = None
        sig_all, sig = self.sq_sig_all, E.IBV_SEND_SIGNALED
        with self.send_lock:
            sq, bell, depth = self.sq, self.doorbell, self.cap.max_send_wr
            while wr is not None:
                if len(sq) >= depth:   # WRs before this one stay posted, as in verbs
                    full = PyverbsRDMAError("Failed to post send", _errno.ENOMEM)
                    break
                self.seq = seq = self.seq + 1
                sq.append(seq)
                bell.append(_WQE(seq, wr.wr_id, wr.opcode, bool(sig_all or wr.send_flags & sig), wr.imm_data, wr.rkey,
                                 wr.remote_addr, wr.compare_add, tuple((g.addr, g.length, g.lkey) for g in wr._sg)))
                wr = wr._next
        if bell:
            self.engine.ring_doorbell(self)
        if full is not None:
            raise full

    def _flush_posted(self, wr: SendWR) -> None:
        """Post the chain ``wr`` on a QP in ERR (under its send lock and the engine lock): each request completes at
        once with ``IBV_WC_WR_FLUSH_ERR``."""
        while wr is not None:
            if len(self.sq) >= self.cap.max_send_wr:
                raise PyverbsRDMAError("Failed to post send", _errno.ENOMEM)
            self.seq += 1
            self.sq.append(self.seq)
            self._start(_WQE(self.seq, wr.wr_id, wr.opcode, bool(self.sq_sig_all or wr.send_flags & E.IBV_SEND_SIGNALED),
                             0, 0, 0, 0, ()))
            wr = wr._next

    def _start(self, w: "_WQE") -> List[bytes]:
        """Execute work queue entry ``w`` (the progress thread, under the engine lock): its records to send."""
        seq = w.seq
        wc_op = E.IBV_WC_FETCH_ADD if w.opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD else E.IBV_WC_RDMA_WRITE
        ent = {"wr_id": w.wr_id, "signaled": w.signaled, "op": wc_op, "result": None}
        self.outstanding[seq] = ent
        if self.state != E.IBV_QPS_RTS:
            self._complete(seq, E.IBV_WC_WR_FLUSH_ERR)
            return []
        addr, _, lkey = w.sges[0]
        mr = self.engine.mrs.get(lkey)
        total = sum(g[1] for g in w.sges)
        bad = mr is None or mr.pd is not self.pd or addr < mr.buf or addr + total > mr.buf + mr.length
        if w.opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            bad = bad or total != 8 or not (mr.access & E.IBV_ACCESS_LOCAL_WRITE)
        elif w.opcode not in (E.IBV_WR_RDMA_WRITE, E.IBV_WR_RDMA_WRITE_WITH_IMM):
            self._error(seq, E.IBV_WC_LOC_QP_OP_ERR)
            return []
        if bad and total:
            self._error(seq, E.IBV_WC_LOC_PROT_ERR)
            return []
        if self.dst is None or self.peer_gone:    # unreachable or gone: the packets go nowhere, no ACK comes back
            self.lost_since = self.lost_since or time.monotonic()
            return []
        res, _ = self._path_resources()
        self.engine.model.charge(("qp", self.ctx.dev_index, self.qp_num), res, total)
        if w.opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            ent["result"] = addr
            return [_pack(_REQ, w.opcode, _F_LAST, self.qp_num, self.dest_qpn, seq, w.rkey, w.remote_addr,
                          8, 0, 0, 0, w.compare_add & ((1 << 64) - 1), 0, self.rnr_retry)]
        data = b"".join(ctypes.string_at(a, n) for a, n, _ in w.sges)
        frag = max(4096, self.engine.fabric.spec.ring_bytes // 4 - _HDR.size - 64)
        recs = []
        off = 0
        while True:
            piece = data[off:off + frag]
            last = off + len(piece) >= total
            recs.append(_pack(_REQ, w.opcode, _F_LAST if last else 0, self.qp_num, self.dest_qpn, seq, w.rkey,
                              w.remote_addr, total, off, len(piece), w.imm & 0xFFFFFFFF, 0, 0,
                              self.rnr_retry, 0, piece))
            off += len(piece)
            if last:
                return recs

    def _complete(self, seq: int, status: int) -> None:
        """Finish requester WR ``seq``: completion if signalled or failed."""
        ent = self.outstanding.pop(seq, None)
        if ent is None:
            return
        if ent["signaled"] or status != E.IBV_WC_SUCCESS:
            wc = WC(ent["wr_id"], status, ent["op"], self.qp_num, 8 if ent["op"] == E.IBV_WC_FETCH_ADD else 0)
            wc._retire = (self, seq)
            self.scq._push(wc)

    def _retire(self, seq: int) -> None:
        # (under the QP's send lock, not the engine's, which the progress thread holds while it places payloads)
        with self.send_lock:
            sq = self.sq
            while sq and sq[0] <= seq:
                sq.popleft()

    def _error(self, seq: int, status: int) -> None:
        self._complete(seq, status)
        self._to_error()

    def _to_error(self) -> None:
        """Enter ERR: flush every outstanding send and posted receive (completions always generated)."""
        self.state = E.IBV_QPS_ERR
        for s in list(self.outstanding):
            self._complete(s, E.IBV_WC_WR_FLUSH_ERR)
        while self.rq:
            self.rcq._push(WC(self.rq.popleft(), E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, self.qp_num))

    def _on_ack(self, rec: bytes) -> None:
        h = _HDR.unpack_from(rec)
        seq, status, value = h[5], h[13], h[12]
        if seq not in self.outstanding:
            return
        ent = self.outstanding[seq]
        if status == E.IBV_WC_SUCCESS and ent["result"] is not None:
            ctypes.memmove(ent["result"], struct.pack("<Q", value), 8)
        if status != E.IBV_WC_SUCCESS:
            self._error(seq, status)
        else:
            self._complete(seq, status)

    # ---- responder
    def _on_request(self, rec: bytes, now: float):
        """Handle one request record; None: not yet (keep it queued); b'' or (qpn, ack): done."""
        (_, opcode, flags, src, _, seq, rkey, raddr, total, off, flen, imm, add, _, rnr_retry, _, _) = \
            _HDR.unpack_from(rec)
        last = flags & _F_LAST

        def reply(status: int, value: int = 0):
            return (src, _pack(_ACK, opcode, 0, self.qp_num, src, seq, add=value, status=status))

        if self.state in (E.IBV_QPS_RESET, E.IBV_QPS_INIT):   # not ready: the requester would retry
            self.early_since = self.early_since or now
            return None if now < self.early_since + 5.0 else reply(E.IBV_WC_RETRY_EXC_ERR)
        self.early_since = None
        if self.state == E.IBV_QPS_ERR:
            return reply(E.IBV_WC_RETRY_EXC_ERR) if last else b""
        if opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM and last and not self.rq:
            st = self.rnr
            if st is None or st["seq"] != seq:
                st = self.rnr = {"seq": seq, "tries": 0, "next": now}
            if now < st["next"]:
                return None
            if rnr_retry != 7 and st["tries"] >= rnr_retry:
                self.rnr = None
                return reply(E.IBV_WC_RNR_RETRY_EXC_ERR)
            st["tries"] += 1
            st["next"] = now + _rnr_delay_s(self.min_rnr_timer)
            return None
        self.rnr = None
        mr = self.engine.mrs.get(rkey)
        if opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            if raddr % 8:
                return self._remote_error(reply, E.IBV_WC_REM_INV_REQ_ERR)
            need = E.IBV_ACCESS_REMOTE_ATOMIC
            length = 8
        else:
            need = E.IBV_ACCESS_REMOTE_WRITE
            length = total
        if length and (mr is None or mr.pd is not self.pd or not (mr.access & need) or not (self.access & need)
                       or raddr < mr.buf or raddr + length > mr.buf + mr.length):
            return self._remote_error(reply, E.IBV_WC_REM_ACCESS_ERR)
        if opcode == E.IBV_WR_ATOMIC_FETCH_AND_ADD:
            old = struct.unpack("<Q", ctypes.string_at(raddr, 8))[0]
            ctypes.memmove(raddr, struct.pack("<Q", (old + add) & ((1 << 64) - 1)), 8)
            self.engine.placements.append((self.qp_num, seq))
            return reply(E.IBV_WC_SUCCESS, old)
        if flen:
            ctypes.memmove(raddr + off, rec[_HDR.size:_HDR.size + flen], flen)
        if not last:
            return b""
        self.engine.placements.append((self.qp_num, seq))
        if opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
            self.rcq._push(WC(self.rq.popleft(), E.IBV_WC_SUCCESS, E.IBV_WC_RECV_RDMA_WITH_IMM, self.qp_num,
                              total, imm, E.IBV_WC_WITH_IMM))
        return reply(E.IBV_WC_SUCCESS)

    def _remote_error(self, reply, status: int):
        self._to_error()
        return reply(status)

    def post_recv(self, wr: RecvWR, bad_wr=None) -> None:
        """Post a chain of receive WRs.  Raises EINVAL in RESET, ENOMEM on a full receive queue. Its CPU time
        counts in :func:`nic_cpu_s`."""
        _counting_nic_cpu(self._post_recv, wr)

    def _post_recv(self, wr: RecvWR) -> None:
        with self.engine.lock:
            while wr is not None:
                if self.state == E.IBV_QPS_RESET:
                    raise PyverbsRDMAError("Failed to post recv: QP in RESET", _errno.EINVAL)
                if self.state == E.IBV_QPS_ERR:
                    self.rcq._push(WC(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, self.qp_num))
                elif len(self.rq) >= self.cap.max_recv_wr:
                    raise PyverbsRDMAError("Failed to post recv", _errno.ENOMEM)
                else:
                    self.rq.append(wr.wr_id)
                wr = wr.next_wr
        self.engine.kick.set()

    def close(self) -> None:
        """Destroy the QP and its ring; the last QP of this process also releases the peers' rings it
        mapped and stops the progress thread."""
        with self.engine.lock:
            self.engine.qps.pop(self.qp_num, None)
            self.engine.out_rings.pop(self.qp_num, None)
        self.ring.close(unlink=True)
        _created_rings.discard(self.ring.path)
        self.engine.release_if_idle()
