"""The data path of the verbs backend (:mod:`triton_ep.transport.verbs`): posting work requests as chains with
selective signalling, prepared requests posted again, receives, polling the CQs and turning work completions
into :class:`Completion` records, bounded waits."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from triton_ep.errors import EPTimeoutError
from triton_ep.transport import topology
from triton_ep.transport.rdma import (FETCH_ADD, WRITE, WRITE_WITH_IMM, Completion, Op, QPInfo, RdmaCompletionError,
                                      RdmaError, Transport)
from triton_ep.transport.verbs_api import WC_STATUS_NAMES, _call
from triton_ep.transport.verbs_memory import Region
from triton_ep.transport.verbs_qp import build_send_wr

_RECV_BIT = 1 << 63
#: the request's number in a send completion's ``wr_id`` (the CQ slot is above it)
_SEQ_BITS = (1 << 56) - 1


@dataclass
class _QP:
    peer: int
    index: int
    slot: int
    port: topology.PortRef
    qp: Any
    info: QPInfo
    flow_label: int = 0
    udp_sport: int = 0
    sport_forced: bool = False
    remote: Optional[QPInfo] = None
    seq: "itertools.count" = field(default_factory=lambda: itertools.count(1))
    inflight: List[tuple] = field(default_factory=list)   # (seq, user wr_id, user-signalled, kind)
    unsignaled_run: int = 0
    recvs_posted: int = 0
    #: key -> the work requests built once by :meth:`VerbsTransport.prepare` (None: this pyverbs cannot reuse them)
    prepared: Dict[Any, Optional["_Prepared"]] = field(default_factory=dict)
    #: receives built once, linked in a fixed chain ``recv_chain[i] -> recv_chain[i + 1] -> ... -> None``: posting
    #: ``n`` of them posts from ``recv_chain[-n]`` (a receive request is free again once ``post_recv`` returns)
    recv_chain: List[Any] = field(default_factory=list)
    #: receive completions polled since the receives were last replenished
    recv_owed: int = 0
    #: some key of :attr:`prepared` could not be built (this pyverbs): :meth:`VerbsTransport.post_prepared` posts Ops
    unprepared: bool = False


@dataclass(eq=False)
class _Prepared:
    """One prepared work request (:meth:`VerbsTransport.prepare`): its ``SGE``, and two ``SendWR``s reading it (set
    through ``sg_list``, so a new length is one store): ``link`` goes where another request follows it in a chain
    (its ``next_wr`` is set at each post), ``last`` ends a chain (never linked: pyverbs cannot set ``next_wr`` back
    to none). ``kind``: the ``Op`` kind; ``stamp``: the post that used it last (a key named twice in one call
    splits the chain)."""
    sge: Any
    link: Any
    last: Any
    kind: str
    stamp: int = -1



class _VerbsDataPath(Transport):
    """:class:`VerbsTransport`'s data path, on the queue pairs (``self.qps``, ``self.by_qpn``), CQs and receive
    scratch MRs that its constructor makes."""

    def _sge(self, q: _QP, region: Region, offset: int, length: int) -> Any:
        return self.api.SGE(region.addr + offset, length, region.lkeys[q.slot])

    def post(self, peer: int, qp: int, ops: Sequence[Op]) -> List[int]:
        """Post ``ops`` in order on one QP; see :meth:`rdma.Transport.post`.  Returns the user wr_ids.

        The ops go out as chains of as many as the send queue has room for (one ``post_send`` per chain).
        A chain that fills the queue ends with a signalled request, and every ``signal_every``-th request is
        signalled, so a full queue always has a completion coming that frees it.
        """
        q = self.qps[(peer, qp)]
        where = dict(device=q.port.device, port=q.port.port, qp_num=q.info.qp_num, peer=peer)
        if q.remote is None:
            raise RdmaError("post before connect()", **where)
        bad = [op.kind for op in ops if op.kind not in (WRITE, WRITE_WITH_IMM, FETCH_ADD)]
        if bad:
            raise RdmaError(f"unknown op kind {bad[0]!r}", **where)
        ids: List[int] = []
        i = 0
        while i < len(ops):
            if len(q.inflight) >= self.sq_depth:
                self.wait(lambda _: len(q.inflight) < self.sq_depth, stage="rdma/send-queue space", peer=peer,
                          channel=qp, keep=True)
            chunk = ops[i:i + self.sq_depth - len(q.inflight)]
            ids += self._post_chain(q, chunk, fills=len(q.inflight) + len(chunk) == self.sq_depth, where=where)
            i += len(chunk)
        return ids

    def _post_chain(self, q: _QP, ops: Sequence[Op], fills: bool, where: dict) -> List[int]:
        """Build and post one chain of send WRs on ``q``; ``fills``: it takes the last free slot."""
        wrs, ids = [], []
        for k, op in enumerate(ops):
            seq = next(q.seq)
            q.unsignaled_run += 1
            sig = op.signaled or q.unsignaled_run >= self.signal_every or (fills and k == len(ops) - 1)
            if sig:
                q.unsignaled_run = 0
            uid = seq if op.wr_id is None else op.wr_id
            rkeys = op.remote.rkeys
            rkey = rkeys[q.remote.dev_slot] if q.remote.dev_slot < len(rkeys) else rkeys[0]
            length = 8 if op.kind == FETCH_ADD else op.length
            wrs.append(build_send_wr(self.api, op.kind, (q.slot << 56) | seq, self._sge(q, op.region, op.offset, length),
                                     rkey, op.remote.addr + op.remote_offset, op.imm, op.add, sig))
            q.inflight.append((seq, uid, op.signaled, op.kind))
            ids.append(uid)
        for a, b in zip(wrs, wrs[1:]):
            a.next_wr = b
        try:
            _call(self.api, "post_send", lambda: q.qp.post_send(wrs[0]), **where)
        except RdmaError:
            del q.inflight[len(q.inflight) - len(wrs):]
            raise
        return ids

    def wait(self, predicate, *, stage: str, peer: Optional[int] = None, timeout_s: Optional[float] = None,
             raise_on_error: bool = True, channel: Optional[int] = None, keep: bool = False) -> List[Completion]:
        """Poll until ``predicate(completions)`` holds; raises ``EPTimeoutError`` after ``timeout_s``.

        With ``keep`` the completions stay queued for the next :meth:`poll` instead of being returned.
        """
        import time
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        got: List[Completion] = []
        spins = 0
        while not predicate(got):
            new = self._poll_cqs(64)
            if keep:
                self._backlog.extend(new)
            else:
                got.extend(new)
                if raise_on_error:
                    self._raise_failed(got)
            if not new:
                if time.monotonic() > deadline:
                    raise EPTimeoutError(self.rank, peer, stage, t, channel)
                spins += 1
                if spins > 32:
                    time.sleep(0.0001)
        return got

    def post_recv(self, peer: int, qp: int, count: int) -> None:
        """Post ``count`` receives (one 64-byte scratch SGE each; WRITE_WITH_IMM writes no payload there), as one
        chain of receive requests built once per QP (``rq_depth`` of them, the first time) and posted again."""
        q = self.qps[(peer, qp)]
        if count <= 0:
            return
        if not q.recv_chain:
            sc = self.scratch[q.slot]
            q.recv_chain = [self.api.RecvWR(wr_id=_RECV_BIT | (q.slot << 56) | q.info.qp_num, num_sge=1,
                                            sg=[self.api.SGE(sc.buf, 64, sc.lkey)]) for _ in range(self.rq_depth)]
            for a, b in zip(q.recv_chain, q.recv_chain[1:]):
                a.next_wr = b
        chain = q.recv_chain
        while count > 0:
            n = min(count, len(chain))
            try:
                q.qp.post_recv(chain[len(chain) - n])
            except self.api.PyverbsError as ex:
                raise RdmaError(f"post_recv failed: {ex}", errno=getattr(ex, "error_code", None),
                                device=q.port.device, port=q.port.port, qp_num=q.info.qp_num, peer=peer) from ex
            q.recvs_posted += n
            count -= n

    def prepare(self, peer: int, qp: int, key: Any, op: Op) -> None:
        """Build ``op``'s work request once for QP ``qp`` of ``peer`` (see :meth:`rdma.Transport.prepare`): an
        ``SGE`` and two ``SendWR``s that read it through ``sg_list``. Where this pyverbs cannot point a request at an
        ``SGE`` or set its immediate (older rdma-core), the key posts through :meth:`post` instead.

        Raises :class:`RdmaError`: a kind other than WRITE / WRITE_WITH_IMM, or a QP not connected."""
        q = self.qps[(peer, qp)]
        if q.remote is None:
            raise RdmaError("prepare before connect()", device=q.port.device, port=q.port.port,
                            qp_num=q.info.qp_num, peer=peer)
        super().prepare(peer, qp, key, op)          # (checks the kind; the fallback's Op)
        rkeys = op.remote.rkeys
        rkey = rkeys[q.remote.dev_slot] if q.remote.dev_slot < len(rkeys) else rkeys[0]
        sge = self.api.SGE(op.region.addr + op.offset, op.length, op.region.lkeys[q.slot])
        pair = [build_send_wr(self.api, op.kind, 0, sge, rkey, op.remote.addr + op.remote_offset, op.imm)
                for _ in range(2)]
        try:
            for wr in pair:
                wr.sg_list = sge
                wr.imm_data = op.imm & 0xFFFFFFFF
        except (AttributeError, TypeError):
            q.prepared[key] = None
            q.unprepared = True
            return
        q.prepared[key] = _Prepared(sge, pair[0], pair[1], op.kind)

    def post_prepared(self, peer: int, qp: int, reqs: Sequence[Tuple[Any, int, int, Optional[int], bool]]) -> None:
        """Post prepared work requests in order on one QP (see :meth:`rdma.Transport.post_prepared`): per request
        only its ``SGE``'s length, its immediate, ``wr_id`` and flags are stored, the requests are linked, and each
        chain (as long as the send queue has room for; a key named twice in one chain ends it) is one
        ``post_send``. Selective signalling as :meth:`post`."""
        q = self.qps[(peer, qp)]
        if q.unprepared:        # (this pyverbs: no reusable requests)
            return super().post_prepared(peer, qp, reqs)
        inflight = q.inflight
        base, n = len(inflight), len(reqs)
        if n == 1 and base < self.sq_depth:     # (the common case: one request, no chain to link)
            key, length, imm, wr_id, signaled = reqs[0]
            p = q.prepared[key]
            seq = next(q.seq)
            q.unsignaled_run += 1
            if signaled or q.unsignaled_run >= self.signal_every or base + 1 == self.sq_depth:
                q.unsignaled_run = 0
                flags = self._send_signaled
            else:
                flags = 0
            wr = p.last
            wr.wr_id = q.slot << 56 | seq
            wr.send_flags = flags
            if p.kind == WRITE_WITH_IMM:
                wr.imm_data = imm & 0xFFFFFFFF
            p.sge.length = length
            inflight.append((seq, seq if wr_id is None else wr_id, signaled, p.kind))
            try:
                q.qp.post_send(wr)
            except self.api.PyverbsError as ex:
                raise self._post_failed(q, base, ex) from ex
            return
        i = 0
        while i < n:
            room = self.sq_depth - len(inflight)
            if room <= 0:
                self.wait(lambda _: len(q.inflight) < self.sq_depth, stage="rdma/send-queue space", peer=peer,
                          channel=qp, keep=True)
                continue
            base = len(inflight)
            head = self._link_prepared(q, reqs, i, min(n, i + room))
            try:
                q.qp.post_send(head)
            except self.api.PyverbsError as ex:
                raise self._post_failed(q, base, ex) from ex
            i += len(inflight) - base

    @staticmethod
    def _post_failed(q: _QP, base: int, ex: Exception) -> RdmaError:
        """``post_send`` on ``q`` raised ``ex``: the requests ``q.inflight`` holds from index ``base`` on were not
        posted (taken out again); returns the :class:`RdmaError` to raise."""
        del q.inflight[base:]
        return RdmaError(f"post_send failed: {ex}", errno=getattr(ex, "error_code", None), device=q.port.device,
                         port=q.port.port, qp_num=q.info.qp_num, peer=q.peer)

    def _link_prepared(self, q: _QP, reqs: Sequence[tuple], i: int, end: int) -> Any:
        """Set up ``reqs[i:end]`` (up to a key met twice) as one linked chain of ``q``'s prepared requests, each
        numbered and entered in ``q.inflight`` (every ``signal_every``-th, and the one that fills the send queue,
        signalled); returns its head."""
        self._stamp = stamp = self._stamp + 1
        prepared, sig_flag, every = q.prepared, self._send_signaled, self.signal_every
        ents, j = [], i
        while j < end:
            p = prepared[reqs[j][0]]
            if p.stamp == stamp:
                break
            p.stamp = stamp
            ents.append(p)
            j += 1
        last = len(ents) - 1
        inflight = q.inflight
        fills = len(inflight) + len(ents) == self.sq_depth
        prev = head = None
        slot_bits = q.slot << 56
        for k, p in enumerate(ents):
            key, length, imm, wr_id, signaled = reqs[i + k]
            seq = next(q.seq)
            q.unsignaled_run += 1
            sig = signaled or q.unsignaled_run >= every or (fills and k == last)
            if sig:
                q.unsignaled_run = 0
            wr = p.last if k == last else p.link
            wr.wr_id = slot_bits | seq
            wr.send_flags = sig_flag if sig else 0
            if p.kind == WRITE_WITH_IMM:
                wr.imm_data = imm & 0xFFFFFFFF
            p.sge.length = length
            if prev is None:
                head = wr
            else:
                prev.next_wr = wr
            prev = wr
            inflight.append((seq, seq if wr_id is None else wr_id, signaled, p.kind))
        return head

    def poll(self, max_entries: int = 64, raise_on_error: bool = True) -> List[Completion]:
        """Completions since the last call (queued ones first); see :meth:`rdma.Transport.poll`."""
        out = self._poll_cqs(max_entries)
        if self._backlog:
            out, self._backlog = self._backlog + out, []
        if raise_on_error and out:
            self._raise_failed(out)
        return out

    def _raise_failed(self, comps: List[Completion]) -> None:
        """Raise :class:`RdmaCompletionError` for the first failed completion in ``comps``."""
        for c in comps:
            if not c.ok:
                q = self.qps.get((c.peer, c.qp))
                raise RdmaCompletionError(f"work request {c.wr_id} ({c.opcode}) failed with {c.status}", c, comps,
                                          device=q.port.device if q else None, port=q.port.port if q else None,
                                          qp_num=c.qp_num, peer=c.peer)

    def _poll_cqs(self, max_entries: int) -> List[Completion]:
        """One ``poll`` of every CQ (up to ``max_entries`` work completions each); a QP whose consumed receives
        reached ``recv_batch`` gets them posted again afterwards, one chain (``auto_replenish``)."""
        out: List[Completion] = []
        owed: List[_QP] = []
        for slot, cq in enumerate(self.cqs):
            try:
                n, wcs = cq.poll(max_entries)
            except self.api.PyverbsError as ex:
                raise RdmaError(f"poll CQ failed: {ex}", errno=getattr(ex, "error_code", None),
                                device=self.devices[slot].name) from ex
            if n:
                completion = self._completion
                for wc in wcs[:n]:
                    c = completion(slot, wc, owed)
                    if c is not None:
                        out.append(c)
        for q in owed:
            n, q.recv_owed = q.recv_owed, 0
            self.post_recv(q.peer, q.index, n)
        return out

    def _completion(self, slot: int, wc: Any, owed: List[_QP]) -> Optional[Completion]:
        """The :class:`Completion` of work completion ``wc`` of CQ ``slot`` (None: nothing to report: an unsignalled
        request's, a flushed receive's); a consumed receive is counted on its QP, which goes into ``owed`` once
        ``recv_batch`` are owed."""
        qp_num, wr_id = wc.qp_num, wc.wr_id
        q = self.by_qpn.get((slot, qp_num))
        ok = wc.status == self._wc_success
        status = "IBV_WC_SUCCESS" if ok else self.e.name_of("IBV_WC_STATUS_", wc.status, WC_STATUS_NAMES)
        if wr_id & _RECV_BIT:   # classify by wr_id: the opcode of an error completion is undefined
            peer = idx = None
            if q is not None:
                peer, idx = q.peer, q.index
                q.recvs_posted -= 1
                if ok and self.auto_replenish:
                    q.recv_owed += 1
                    if q.recv_owed == self.recv_batch:
                        owed.append(q)
            if not ok and status == "IBV_WC_WR_FLUSH_ERR":
                return None   # a flushed receive: the send side reports the failure
            return Completion(status, "recv_imm", wr_id & ~_RECV_BIT, int(wc.imm_data) if ok else None,
                              qp_num, peer, idx, int(wc.byte_len))
        if q is None:
            return Completion(status, "unknown", wr_id, None, qp_num, None, None)
        seq = wr_id & _SEQ_BITS
        inflight = q.inflight
        k = seq - inflight[0][0] if inflight else -1      # (a QP's requests are numbered 1, 2, 3, ... in order)
        if not 0 <= k < len(inflight) or inflight[k][0] != seq:     # (numbers skipped by a failed post: search)
            k = next((i for i, ent in enumerate(inflight) if ent[0] == seq), -1)
            if k < 0:
                return None
        _, uid, usig, kind = inflight[k]
        del inflight[:k + 1]   # this completion retires every earlier (unsignalled) request of the QP
        if usig or not ok:
            return Completion(status, kind, uid, None, qp_num, q.peer, q.index, int(wc.byte_len))
        return None
