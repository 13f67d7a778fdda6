"""The proxy thread: its loop (:meth:`ProxyThreads._run`), one sweep (completions, the ring words, faults, posts,
credits, probes, bounds), the completions it turns into ``TAIL`` and ``SENT``, and :meth:`ProxyThreads.fail`, which
tells the peers."""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

from triton_ep.errors import EPError
from triton_ep.transport.rdma import WRITE, Completion, Op
from triton_ep.transport.ring_flags import RingFlags

from .faults import (CLOSED, ROOT_CLOSED, ROOT_FAILED, STAGE_INTERNAL, STAGE_NAMES, STAGE_POST, STAGE_RECV_CQE,
                     STAGE_SEND_CQE, STAGE_SEND_WAIT, PeerClosedError, PeerGoneError, ProxyError, ProxyRemoteError,
                     RootCauseError, fault_gone, fault_word, mode_root, parse_close, parse_fault, stage_code)
from .layout import _QPState
from .liveness import STATUS_FLUSHED, STATUS_GONE, TAG_PROBE, Liveness, probe_request
from .posting import _CHUNK_OPS, _SEQ_MASK, IMM_SEQ_BITS, IMM_SEQ_MASK, TAG_CHUNK, is_probe_completion


class ProxyThreads:
    """The :class:`~triton_ep.scheduler.Scheduler`'s proxy threads (a part of it: its state is the scheduler's):
    each runs sweeps over the QPs it owns until the scheduler stops or fails."""

    def _init_sweep(self) -> None:
        """The sweep's state: where it finds each peer's words in a snapshot of the ring words, when it next checks
        the bounds, whether it posts receives again, and the liveness probes' state."""
        # (with arrival words no WRITE_WITH_IMM arrives: no receive is consumed, none is posted)
        self._replenish = not getattr(self.t, "auto_replenish", False) and not self.arrival_words
        #: where the sweep finds each array in :meth:`RingFlags.snapshot` (``array[p]`` at its index + ``p``; ``LEN`` and
        #: ``ARRIVE``: + ``p * slots + slot``)
        R, f = self.world, self.flags
        self._w_head, self._w_credit, self._w_fault = ((a - RingFlags.READY) * R for a in
                                                       (RingFlags.HEAD, RingFlags.CREDIT, RingFlags.FAULT))
        self._w_len, self._w_masked, self._w_arrive = f.len0, f.masked0, f.arrive0
        #: word indices of ``TAIL[p]``, ``SENT[p]`` and ``SRC[p]`` (the sweep stores them into ``flags.w`` directly)
        self._i_tail, self._i_sent, self._i_src = ([f.index(a, p) for p in range(R)]
                                                   for a in (RingFlags.TAIL, RingFlags.SENT, RingFlags.SRC))
        #: the words every sweep reads (:meth:`RingFlags.snapshot_view`, a view kept: ``tolist()`` per sweep)
        self._words = f.snapshot_view()
        #: what a sweep reads of its scheduler's sizes, in one tuple: where ``CREDIT``, ``MASKED`` and ``HEAD`` start in
        #: the snapshot, the slots, a credit's pace (:meth:`_credit`), and the slice of the ``FAULT`` words
        self._sweep_at = (self._w_credit, self._w_masked, self.slots, self._w_head, self._credit_every,
                          slice(self._w_fault, self._w_fault + R))
        #: when the sweep next checks the chunks in flight against ``timeout_s`` (monotonic seconds; every 1 ms)
        self._bound_at = 0.0
        #: the liveness probes (:class:`Liveness`): when the next round goes, the probes in flight, the suspects
        self.liveness = Liveness()

    def _run(self, own: List[_QPState]) -> None:
        idle = 0
        try:
            wall, cpu = time.perf_counter_ns, time.thread_time_ns
            stop, lock, sweep, w, beat = self._stop, self._lock, self._sweep, self.flags.w, RingFlags.BEAT
            # The thread's CPU clock (a system call, about 1 µs) is read once per pass: after a busy sweep (whose CPU
            # time runs from the previous read) and after an idle sweep's wait (where the next sweep's time starts).
            c0 = cpu()
            while not stop.is_set():
                t0 = w[beat] = wall()   # (the heartbeat: a proxy process's rank tells a stopped proxy by it)
                with lock:        # (the counters too: proxy threads share them, stats() reads them whole)
                    self._sweep_tx_ns = self._sweep_tx_cpu_ns = 0
                    did = sweep(own)
                    if did:
                        c1 = cpu()
                        self._busy_ns += wall() - t0
                        self.busy_sweeps += 1
                        self._busy_cpu_ns += c1 - c0
                        self._transport_ns += self._sweep_tx_ns
                        self._transport_cpu_ns += self._sweep_tx_cpu_ns
                if did:
                    idle, c0 = 0, c1
                else:
                    idle = 0 if self._idle_wait(idle + 1) else idle + 1
                    c0 = cpu()
        except BaseException as ex:   # noqa: BLE001  (recorded, raised by check() in the caller's thread)
            self.fail(ex)

    def _idle_wait(self, idle: int) -> bool:
        """The proxy thread's pause after ``idle`` sweeps in a row that moved nothing: a yield for the first 20, then
        50 µs (a proxy thread waits for the GIL anyway while the rank's Python runs). Returns whether something woke
        it that restarts the count (never here; the proxy process's scheduler backs off further and has a doorbell:
        :class:`triton_ep.proxy_process.ProxySweeps`)."""
        time.sleep(0 if idle < 20 else 0.00005)
        return False

    def fail(self, ex: BaseException) -> None:
        """Record ``ex`` as this scheduler's error (the first one wins), end every ring wait (the abort
        word), stop the proxy threads and tell every peer through its ``FAULT`` word, so they raise
        :class:`ProxyRemoteError` instead of waiting out their bound (:class:`RootCauseError` where ``ex`` names the
        rank of the mode's numbering that it passes on: :func:`~.faults.root_cause`).  Host waits that time out call
        this; so does a failing proxy thread."""
        code = stage_code(ex)
        if not isinstance(ex, EPError):
            ex = ProxyError(self.rank, getattr(ex, "peer", None), None, None, STAGE_NAMES[STAGE_INTERNAL],
                            f"{type(ex).__name__}: {ex}")
        with self._lock:
            first = self.error is None
            if first:
                self.error = ex
        self.flags.abort(2)
        self._stop.set()
        if first and isinstance(ex, PeerGoneError) and self.on_gone is not None:
            self.on_gone(ex.peer)
        if not first or isinstance(ex, ProxyRemoteError) or getattr(ex, "told_by", None) is not None:
            return      # (the peer that failed, or found a rank gone, told its peers itself)
        gone = ex.peer if isinstance(ex, PeerGoneError) else None
        self.flags.put(RingFlags.SRC, self.rank,
                       fault_word(code, getattr(ex, "channel", None), getattr(ex, "qp", None), gone,
                                  None if gone is not None else getattr(ex, "root_cause", None)))
        lay = self.layout
        with self._lock:
            for p in self.peers:                # every QP: the one that failed may be any of them
                for q in range(self.t.num_qps_per_peer):
                    try:
                        self.t.post(p, q, [Op(WRITE, self.region, lay.word_off(RingFlags.SRC, self.rank), 8,
                                              self._remote[p], lay.word_off(RingFlags.FAULT, self.rank))])
                    except Exception:   # noqa: BLE001  (best effort: a broken QP cannot carry it)
                        pass

    def _sweep(self, own: List[_QPState]) -> bool:
        """One pass of a proxy thread: completions, the ring words, faults, posts, credits, probes, bounds.  Returns
        whether anything moved.  Raises ProxyError."""
        did = self._completions()
        words = self._words.tolist()        # READY .. SRC, LEN, MASKED, ARRIVE of every peer: one read
        if self.arrival_words:
            did |= self._arrivals(words)
        c0_, m0, S, _, _, faults = self._sweep_at
        if any(words[faults]):        # (the rare case)
            self._raise_fault(words)
        now = time.monotonic()
        # per QP: Ops to post (a test hook replaced _chunk_ops), or prepared work requests (key, length, imm,
        # wr_id, signaled): one post call per QP and sweep either way
        batches: Optional[Dict[Tuple[int, int], list]] = None
        prepared = False
        for p, st in self._peer_list:
            ready = words[p]
            if ready <= st.next_post:           # (nothing ready: no call)
                st.stall_since = None
                continue
            if words[m0 + p]:                   # a masked peer's chunks are dropped, counted as placed
                self._drop_masked(p, st, ready)
                did = True
                continue
            credit = words[c0_ + p]
            if credit < st.credit_floor:
                credit = st.credit_floor
            if st.next_post - credit >= S:      # (no room at the peer: no call but the stall's clock)
                self._stalled(p, st, credit, now)
                continue
            if batches is None:
                batches = {}
                prepared = self._prepared and getattr(self._chunk_ops, "__func__", None) is _CHUNK_OPS
                picks = self._picks
                owner = own[0].owner if own else -1
            if prepared:        # (chunks of one WRITE each: prepared work requests)
                did |= self._place_prepared(p, st, picks.get((owner, p), ()), ready, credit, now, batches, words)
            else:
                did |= self._gather(p, st, picks.get((owner, p), ()), ready, credit, now, batches, words)
        if batches:
            self._post_batches(batches, prepared)
        return self._credits_probes_bounds(words, now) or did

    def _completions(self) -> bool:
        """Step 1 of a sweep: one ``Transport.poll()`` (its wall and CPU time counted as the transport's), each
        completion to :meth:`_on_completion`. Returns whether any came. Raises ProxyError where the poll fails."""
        wall, split = time.perf_counter_ns, self._cpu_split
        t0, c0 = wall(), (time.thread_time_ns() if split else 0)       # (_tx_begin / _tx_done, inline)
        try:
            comps = self.t.poll(raise_on_error=False)
        except Exception as ex:   # noqa: BLE001
            raise ProxyError(self.rank, None, None, None, STAGE_NAMES[STAGE_SEND_CQE], f"poll failed: {ex}") from ex
        finally:
            if split:
                self._sweep_tx_cpu_ns += time.thread_time_ns() - c0
            self._sweep_tx_ns += wall() - t0
        if not comps:
            return False
        on = self._on_completion
        for c in comps:
            on(c)
        return True

    def _credits_probes_bounds(self, words: list, now: float) -> bool:
        """The last steps of a sweep (``words``: this sweep's ring words; ``now``: its monotonic seconds): credits
        for the slots consumers freed (a masked peer's at arrival), the liveness probes when due, and every 1 ms
        the bound on chunks in flight. Returns whether a credit went out. Raises ProxyError past the bound."""
        did = False
        _, m0, _, h0, every, _ = self._sweep_at
        for p, st in self._peer_list:
            head = words[h0 + p]
            if head > st.credit_sent:           # (the common case, nothing freed, without a call)
                if head - st.credit_sent >= every or head >= st.tail:     # (_credit's rule, inline)
                    did |= self._credit(p, head)
            elif st.tail > st.credit_sent and words[m0 + p]:
                did |= self._credit(p, st.tail)   # nothing consumes a masked peer's chunks: slots go back on arrival
            if words[m0 + p] and not st.gave_told:
                did |= self._tell_gave_up(p, st)  # (a peer this rank's kernels gave up on is told so, once)
        if now >= self.liveness.next_at:
            self._probe(now)
        if now >= self._bound_at and self._busy_qps:     # (every 1 ms: the bound is seconds)
            self._bound_at = now + 0.001
            for q in self._busy_qps:           # (the QPs with chunks in flight, not all of them)
                if q.inflight and now - q.inflight[0][2] > self.timeout_s and not self.flags.masked(q.peer):
                    raise ProxyError(self.rank, q.peer, q.channel, q.qp, STAGE_NAMES[STAGE_SEND_WAIT],
                                     f"chunk {q.inflight[0][0]} not completed within {self.timeout_s:g} s")
        return did

    def _raise_fault(self, words: list) -> None:
        """A peer's ``FAULT`` word is set (``words``: :meth:`RingFlags.snapshot`): unless that peer is masked, raise
        :class:`RootCauseError` where it names a root of the mode's numbering (:data:`~.faults.MODE_ROOT`),
        :class:`PeerGoneError` where it names a gone rank (not masked here), else :class:`ProxyRemoteError`. A close
        word (:func:`~.faults.close_word`) raises only where it names a root that failed or is gone (not this rank, not
        masked here): that rank's error, told by the closing peer; after a clean close, or a close after a peer's clean
        close (:data:`~.faults.ROOT_CLOSED`), the probes find the peer's QPs gone (:class:`PeerClosedError`,
        :meth:`_closed_error`)."""
        f0, m0 = self._w_fault, self._w_masked
        for p in self.peers:
            w = words[f0 + p]
            if w and not words[m0 + p]:
                st, ch, q = parse_fault(w)
                root = mode_root(w)
                if root is not None:
                    raise RootCauseError(self.rank, p, ch, q, STAGE_NAMES.get(st, "rdma proxy"),
                                         f"the peer's proxy failed because of a rank it does not reach over RDMA "
                                         f"(rank {root[0]} of the mode's numbering, {root[1]})", *root)
                gone = fault_gone(w)
                if w & CLOSED:
                    root, how = parse_close(w)
                    if how in (None, ROOT_CLOSED) or root == self.rank or (root in self._peer and words[m0 + root]):
                        continue
                    if how == ROOT_FAILED:
                        raise ProxyRemoteError(self.rank, root, None, None, STAGE_NAMES.get(st, "rdma proxy"),
                                               "its RDMA proxy failed; a peer that heard of it destroyed its Buffer "
                                               "and told this rank")
                if gone is not None and gone != self.rank and not (gone in self._peer and words[m0 + gone]):
                    raise PeerGoneError(self.rank, gone, None, None, STAGE_NAMES.get(st, "rdma proxy"),
                                        "its QPs stopped acknowledging a peer's RDMA proxy", told_by=p)
                raise ProxyRemoteError(self.rank, p, ch, q, STAGE_NAMES.get(st, "rdma proxy"),
                                       "the peer's proxy failed there and told its peers")

    def _probe(self, now: float) -> None:
        """Post a liveness probe (prepared at start: 8 bytes, signalled, ``wr_id`` :data:`TAG_PROBE` | peer) on QP 0
        of each peer that is not masked and has none in flight; the next round in :data:`PROBE_S`. Its completion
        clears it; an error completion fails the proxy (:meth:`_on_completion`: ``PeerGoneError`` where the peer
        never acknowledged it). Raises ProxyError where the post itself fails."""
        live = self.liveness
        for p in live.round(now, self.peers, self.flags.masked):
            t0, c0 = self._tx_begin()
            try:
                self.t.post_prepared(p, 0, probe_request(p))
            except Exception as ex:   # noqa: BLE001
                raise ProxyError(self.rank, p, 0, 0, STAGE_NAMES[STAGE_POST],
                                 f"liveness probe: {type(ex).__name__}: {ex}") from ex
            finally:
                self._tx_done(t0, c0)
            live.posted(p)
            self.probes_posted += 1

    def _arrivals(self, words: list) -> bool:
        """With arrival words: move each peer's ``TAIL`` past the chunks whose arrival words have landed (in order; a
        slot's word is ``k + 1`` once chunk ``k`` is placed there; ``words``: :meth:`RingFlags.snapshot`). Returns
        whether a tail moved."""
        S, moved, a0 = self.slots, False, self._w_arrive
        for p, st in self._peer_list:
            tail = st.tail
            while words[a0 + p * S + tail % S] > tail:
                if self.on_signal is not None:
                    self.on_signal(p, None, tail)
                if self.trace:
                    self._event("arrive", p, None, None, tail, 0)
                tail += 1
            if tail != st.tail:
                st.tail = tail
                self.flags.put(RingFlags.TAIL, p, tail)
                moved = True
        return moved

    def _on_completion(self, c: Completion) -> None:
        """One completion of the sweep's poll. A successful one (the common case, looked at first): a run's receive
        (its WRITE_WITH_IMM landed: :func:`~.posting.chunk_imm` names the run's chunks, all placed) moves
        ``TAIL[peer]`` past every chunk that arrived in order (the rest wait in ``arrived``; without the transport's
        own replenishing, one receive is posted again), a chunk's signalled send retires it and those before it on
        its QP (:meth:`_retire`), a probe's clears it (:class:`Liveness`). A failed one: :meth:`_failed`."""
        peer = c.peer
        if peer is None:            # not one of our QPs' (cannot happen with one transport per scheduler)
            return
        if c.status != "IBV_WC_SUCCESS":
            return self._failed(c, peer)
        if c.opcode == "recv_imm":     # a run's WRITE_WITH_IMM landed: its chunks are placed (chunk_imm)
            st = self._peer[peer]
            tail, imm = st.tail, c.imm
            ahead = (imm - tail) & IMM_SEQ_MASK
            if ahead < self.slots:      # (else a chunk numbered before a renumbering, already counted: rebase)
                seq = tail + ahead      # (the run's last chunk; it began imm >> 24 chunks before)
                first = seq - (imm >> IMM_SEQ_BITS)
                if self.on_signal is not None or self.trace:
                    for s in range(max(first, tail), seq + 1):
                        if self.on_signal is not None:
                            self.on_signal(peer, c.qp, s)
                        if self.trace:
                            self._event("arrive", peer, c.qp // self.qps_per_channel, c.qp, s, 0)
                if first <= tail:       # (the common case: in order: TAIL moves at once)
                    tail = seq + 1
                    arrived = st.arrived
                    while arrived and tail in arrived:
                        arrived.discard(tail)
                        tail += 1
                    st.tail = tail
                else:                   # (past a gap: it waits in the arrived set)
                    st.arrived.update(range(first, seq + 1))
                self.flags.w[self._i_tail[peer]] = tail
            if self._replenish:         # (a transport that does not replenish its receives itself)
                t0, c0 = self._tx_begin()
                self.t.post_recv(peer, c.qp, 1)
                self._tx_done(t0, c0)
            return
        wr_id = c.wr_id
        if wr_id & TAG_CHUNK:
            self._retire(self._qps[(peer, c.qp)], wr_id & _SEQ_MASK)
        elif wr_id & TAG_PROBE:
            qp_failed = self.liveness.answered(peer, True)
            if qp_failed is not None:
                raise qp_failed             # the peer acknowledged QP 0 after its other QP failed: that QP

    def _failed(self, c: Completion, peer: int) -> None:
        """A failed completion ``c`` of a QP to ``peer``: nothing where ``peer`` is masked or a suspect's flushed
        request (its probe tells); a suspicion (:meth:`Liveness.suspect`) for a data QP's request the peer never
        acknowledged; else :class:`PeerGoneError` (QP 0's or a probe's) or :class:`ProxyError`, raised."""
        probe = is_probe_completion(c)
        if probe:
            qp_failed = self.liveness.answered(peer, False)
            if qp_failed is not None:
                raise qp_failed
        if self.flags.masked(peer):        # a masked (dead) peer's QPs may fail: nothing waits for them
            return
        stage = STAGE_RECV_CQE if c.opcode == "recv_imm" else STAGE_SEND_CQE
        ch = None if c.qp is None else c.qp // self.qps_per_channel
        what = f"work completion {c.status} ({c.opcode}, wr_id {c.wr_id:#x}, QP number {c.qp_num})"
        if c.status == STATUS_GONE and (probe or c.qp == 0):
            word = self.flags.get(RingFlags.FAULT, peer)
            if word & CLOSED:
                raise self._closed_error(peer, word, ch, c.qp, STAGE_NAMES[stage], what)
            raise PeerGoneError(self.rank, peer, ch, c.qp, STAGE_NAMES[stage],
                                f"its QP {c.qp} stopped acknowledging: {what}, after the QP's retries")
        if c.status == STATUS_GONE:         # a data QP: that QP failed, or the whole peer? a probe tells
            self.liveness.suspect(peer, ProxyError(self.rank, peer, ch, c.qp, STAGE_NAMES[stage], what))
            return
        if c.status == STATUS_FLUSHED and peer in self.liveness.suspects:
            return      # (the rest of a suspect's failed QP, flushed after its first error: the probe tells)
        raise ProxyError(self.rank, peer, ch, c.qp, STAGE_NAMES[stage], what)

    def _closed_error(self, peer: int, word: int, ch: Optional[int], qp: Optional[int], stage: str,
                      what: str) -> PeerClosedError:
        """The error for ``peer``'s QPs found gone (``what``: the completion; ``ch``/``qp``: its channel and QP) after
        its close word ``word``: :class:`PeerClosedError` naming the rank that left first, the one the word names where
        ``peer`` closed because of that rank's clean close (:data:`~.faults.ROOT_CLOSED`; not this rank, not masked
        here), else ``peer``."""
        root, how = parse_close(word)
        if how == ROOT_CLOSED and root != self.rank and not (root in self._peer and self.flags.masked(root)):
            return PeerClosedError(self.rank, root, None, None, stage,
                                   f"it destroyed its Buffer first; a peer that closed after it, because of it, named it "
                                   f"in its close word, and then its QPs went: {what}")
        return PeerClosedError(self.rank, peer, ch, qp, stage,
                               f"the peer destroyed its Buffer (its close word came first): {what}")

    def _retire(self, q: _QPState, seq: int) -> None:
        """A signalled chunk ``seq`` of ``q`` completed: it and every earlier chunk of ``q`` are placed."""
        inflight = q.inflight
        if not inflight or inflight[0][0] > seq:
            return
        st = q.peer_state
        port = q.port_w
        sent, done = st.sent, st.sent_set
        while inflight and inflight[0][0] <= seq:
            s, n, _ = inflight.popleft()
            q.out_bytes -= n
            port[0] -= n
            if s == sent:           # (in order: no set)
                sent += 1
            elif s > sent:          # (below: a chunk numbered before a renumbering, rebase)
                done.add(s)
        while done and sent in done:
            done.discard(sent)
            sent += 1
        st.sent = sent
        if q.parked:            # (_room: its window has room again)
            self._room(q)
        if not inflight:
            self._busy_qps.discard(q)
        self.flags.w[q.i_sent] = sent
