"""Chunk preparation and posting, the proxy's send side: the QP picker (:meth:`ChunkPosting._choose`), the chains
of work requests a sweep posts per QP (prepared once per ring slot and QP, or built as ``Op``s), chunk signals, and
credit WRITEs."""
from __future__ import annotations

import collections
import operator
import time
from typing import Dict, List, Optional, Tuple

from triton_ep.protocol import signal_header as F
from triton_ep.transport.rdma import WRITE, WRITE_WITH_IMM, Op
from triton_ep.transport.ring_flags import RingFlags

from .faults import STAGE_NAMES, STAGE_POST, STAGE_CREDIT, ProxyError
from .layout import _PeerState, _QPState
from .liveness import PROBE_KEY, TAG_PROBE

#: wr_id tag of a chunk's signal (the low bits hold the chunk number)
TAG_CHUNK = 1 << 60
_SEQ_MASK = (1 << 48) - 1
#: a chunk signal's immediate: the low :data:`IMM_SEQ_BITS` bits of the last chunk number of a run, and above them the
#: run's length less one (at most :data:`MAX_RUN` chunks: consecutive numbers on one QP, :func:`chunk_imm`)
IMM_SEQ_BITS = 24
IMM_SEQ_MASK = (1 << IMM_SEQ_BITS) - 1
MAX_RUN = 1 << (32 - IMM_SEQ_BITS)
#: the most bytes one WRITE of merged chunks carries (1 GiB: mlx5's ``max_msg_sz``; the verbs spec allows 2 GiB)
MAX_WRITE_BYTES = 1 << 30


def chunk_imm(seq: int, count: int = 1) -> int:
    """The immediate (32 bits) of the WRITE_WITH_IMM that signals chunks ``seq - count + 1 .. seq`` (``count``
    consecutive chunks on one QP, 1..:data:`MAX_RUN`; all but the last went as plain WRITEs before it on that QP,
    so its receive completion says every one of them is placed): ``(count - 1) << 24 | seq mod 2**24``. The
    receiver widens the number against its tail (a chunk in flight is less than ``slots`` past it)."""
    return (count - 1) << IMM_SEQ_BITS | (seq & IMM_SEQ_MASK)


def is_chunk_signal(op: Op) -> bool:
    """Whether ``op`` is a chunk's signal (its WRITE_WITH_IMM, or with arrival words its arrival-word WRITE): the
    work request whose ``wr_id`` carries :data:`TAG_CHUNK` and the chunk number. Test hooks that move or drop a
    chunk's signal pick it with this."""
    return op.wr_id is not None and bool(op.wr_id & TAG_CHUNK)


def is_probe_completion(c) -> bool:
    """Whether completion ``c`` (a :class:`~triton_ep.transport.rdma.Completion`) is a liveness probe's (its send:
    ``wr_id`` with :data:`~.liveness.TAG_PROBE`, not a chunk's), whatever its status: the sweep's probes and the
    close words that ride on them (:func:`~.liveness.probe_request`)."""
    wr_id = c.wr_id
    return c.opcode != "recv_imm" and wr_id is not None and bool(wr_id & TAG_PROBE) and not wr_id & TAG_CHUNK



class ChunkPosting:
    """The :class:`~triton_ep.scheduler.Scheduler`'s send side (a part of it: its state is the scheduler's): which
    QP each ready, credited chunk goes on, its work requests, one post call per QP and sweep, and the credit
    WRITEs that give a peer its slots back."""

    def _init_posting(self) -> None:
        """The send side's state: the arrival words' offsets and prepared keys, the QP picker's lists of QPs with room
        (filled by :meth:`_plan_qps`), the QPs with chunks in flight, and the credits' pace."""
        S = self.slots
        #: byte offsets of this rank's arrival words at a peer, per slot (where its chunks' arrival words go)
        self._arrive_off = [8 * F.ring_arrive_word.host(self.world, S, self.rank, k) for k in range(S)]
        #: per (proxy thread, peer, port): its QPs with room in their window (:meth:`_room` keeps it), and the QPs
        #: with chunks in flight
        self._rooms: Dict[Tuple[int, int], Dict[str, list]] = {}
        self._picks: Dict[Tuple[int, int], List[Tuple[list, List[int]]]] = {}
        self._busy_qps: set = set()
        #: a credit goes once the consumer freed this many slots since the last (or caught up)
        self._credit_every = max(1, S // 2)
        #: the prepared keys of each slot's two work requests with arrival words (data, arrival word)
        self._arrival_keys = [((0, k), (1, k)) for k in range(S)]

    def _prepare_wrs(self) -> None:
        """Build each chunk's work requests once per ring slot and QP (:meth:`Transport.prepare`), for chunks of one
        WRITE (``wr_bytes`` at least ``slot_bytes``): the WRITE_WITH_IMM of slot ``k`` (key ``k``: a run's last chunk,
        :meth:`_place_prepared`) and its plain WRITE (key ``(0, k)``: the run's other chunks; with one slot there are
        none), or with arrival words the data WRITE (key ``(0, k)``) and the arrival word's WRITE (key ``(1, k)``). A
        sweep then posts them
        with only length, immediate, ``wr_id`` and completion request new (:meth:`Transport.post_prepared`). Each peer's
        credit WRITE (8 bytes of ``SRC[p]`` into the peer's ``CREDIT[me]``, QP 0) is prepared too (key ``"credit"``)."""
        lay = self.layout
        for p in self.peers:        # the credit WRITE of each peer (:meth:`_credit`), whatever the chunks' shape
            self.t.prepare(p, 0, _CREDIT_KEY, Op(WRITE, self.region, lay.word_off(RingFlags.SRC, p), 8,
                                                 self._remote[p], lay.word_off(RingFlags.CREDIT, self.rank)))
            # the liveness probe (:meth:`_probe`): this rank's fault word (0 while healthy) into the peer's FAULT[me]
            self.t.prepare(p, 0, PROBE_KEY, Op(WRITE, self.region, lay.word_off(RingFlags.SRC, self.rank), 8,
                                                self._remote[p], lay.word_off(RingFlags.FAULT, self.rank)))
        self._prepared = self.wr_bytes >= self.slot_bytes
        if not self._prepared:
            return
        for p in self.peers:
            rem = self._remote[p]
            for qp in range(self.t.num_qps_per_peer):
                for k in range(self.slots):
                    src, dst = lay.send_off(p, k), lay.recv_off(self.rank, k)
                    if self.slots > 1 or self.arrival_words:     # (a chunk of a run that is not its last)
                        self.t.prepare(p, qp, (0, k), Op(WRITE, self.region, src, self.slot_bytes, rem, dst))
                    if not self.arrival_words:
                        self.t.prepare(p, qp, k, Op(WRITE_WITH_IMM, self.region, src, self.slot_bytes, rem, dst))
                        continue
                    self.t.prepare(p, qp, (1, k), Op(WRITE, self.region, 8 * self.flags.asrc_index(p, k), 8, rem,
                                                     self._arrive_off[k]))

    def _post_batches(self, batches: Dict[Tuple[int, int], list], prepared: bool) -> None:
        """One post call per QP of this sweep's chains (:meth:`_place_prepared`: prepared work requests;
        :meth:`_gather`: ``Op``s)."""
        wall, split = time.perf_counter_ns, self._cpu_split
        for (p, qp), ops in batches.items():
            t0, c0 = wall(), (time.thread_time_ns() if split else 0)
            try:
                if prepared:
                    self.t.post_prepared(p, qp, ops)
                else:
                    self.t.post(p, qp, ops)
            except Exception as ex:   # noqa: BLE001
                raise ProxyError(self.rank, p, qp // self.qps_per_channel, qp, STAGE_NAMES[STAGE_POST],
                                 f"{type(ex).__name__}: {ex}") from ex
            finally:
                if split:
                    self._sweep_tx_cpu_ns += time.thread_time_ns() - c0
                dt = wall() - t0
                self._sweep_tx_ns += dt
                self._post_ns += dt
            self.wrs_posted += len(ops)

    def _choose(self, own: List[_QPState], peer: int) -> Optional[_QPState]:
        """The QP for the next chunk to ``peer``: the port with the fewest bytes posted so far (so the ports'
        totals never differ by more than one chunk), then least outstanding bytes on the port and on the QP,
        then least bytes so far (equal loads deal round-robin); ``None`` when every QP has a full window (a
        congested port's QPs fill their windows and are passed over, so the other port takes the chunks)."""
        return self._pick(self._picks.get((own[0].owner if own else -1, peer), ()))

    def _pick(self, ports: List[Tuple[list, List[int]]]) -> Optional[_QPState]:
        """:meth:`_choose` over ``ports``, one proxy thread's ``(room, [outstanding, total])`` per port for one peer:
        ``room`` lists the port's QPs with room in their window (:meth:`_room`); its best QP is their minimum by
        ``(out_bytes, total_bytes, qp index)`` (one ``min`` in C), and the port key decides between the ports'."""
        one = len(ports) == 1       # (one port: its best QP, no port key)
        best, key = None, None
        for room, pw in ports:
            if not room:
                continue
            q = min(room, key=_QP_ORDER)
            if one:
                return q
            k = (pw[1], pw[0], q.out_bytes, q.total_bytes, q.qp)
            if key is None or k < key:
                best, key = q, k
        return best

    def _room(self, q: _QPState) -> None:
        """``q``'s chunks in flight changed: it leaves its port's list of QPs with room once its window is full
        (``parked``), and comes back once completions free it."""
        if len(q.inflight) >= self.max_chunks_per_qp:
            if not q.parked:
                q.room.remove(q)
                q.parked = True
        elif q.parked:
            q.room.append(q)
            q.parked = False

    def _gather(self, p: int, st: _PeerState, picks, ready: int, credit: int, now: float,
                batches: Dict[Tuple[int, int], list], words: list) -> bool:
        """Move ready (below ``ready``, ``READY[p]``), credited (below ``credit + slots``) chunks for peer ``p`` into
        per-QP chains of ``Op``s in ``batches`` (accounted as posted), each on the QP the picker chooses among
        ``picks``: the path of a test hook that replaced :meth:`_chunk_ops`, or of chunks of several WRITEs
        (:meth:`_place_prepared` is the other). ``words``: the sweep's :meth:`RingFlags.snapshot`. Returns whether
        any chunk went."""
        chains = self._place(p, st, picks, min(ready, credit + self.slots), now, words)
        self._chain_ops(p, chains, batches)
        if st.next_post < ready and st.next_post - credit >= self.slots:
            self._stalled(p, st, credit, now)
        else:
            st.stall_since = None
        return bool(chains)

    def _drop_masked(self, p: int, st: _PeerState, ready: int) -> None:
        """A masked peer's chunks (below ``ready``) are dropped, counted as placed."""
        st.next_post = st.sent = ready
        st.stall_since = None
        self.flags.put(RingFlags.SENT, p, ready)

    def _chunk_len(self, p: int, q: _QPState, seq: int, words: list) -> int:
        """Bytes of chunk ``seq`` for ``p`` (its ``LEN`` word in ``words``). Raises :class:`ProxyError` outside
        ``1..slot_bytes``."""
        n = words[self._w_len + p * self.slots + seq % self.slots]
        if not 0 < n <= self.slot_bytes:
            raise ProxyError(self.rank, p, q.channel, q.qp, STAGE_NAMES[STAGE_POST],
                             f"chunk {seq} has length {n} (expected 1..{self.slot_bytes})")
        return n

    def _place_prepared(self, p: int, st: _PeerState, picks, ready: int, credit: int, now: float,
                        batches: Dict[Tuple[int, int], list], words: list) -> bool:
        """Peer ``p``'s chunks from ``st.next_post`` up to ``ready`` (``READY[p]``) and ``credit + slots``, in runs of
        consecutive chunks, each run on the QP the picker chooses among ``picks`` (until none has room), accounted as
        posted, appended to that QP's chain in ``batches`` as prepared work requests. A run takes ``ceil(m / r)``
        chunks of the ``m`` to place (``r``: the QPs with room; at most the QP's free window and :data:`MAX_RUN`), so
        a burst deals the QPs the same number of chunks as one chunk per pick would, only consecutive ones. A run's
        chunks sit in consecutive slots (until the ring's end), so its full chunks and the one after each go as one
        WRITE from the first one's slot (``wr_bytes`` left to its default; else a WRITE per chunk): plain WRITEs
        up to a partial chunk, the ring's end or :data:`MAX_WRITE_BYTES`, and last the WRITE_WITH_IMM whose immediate names the run
        (:func:`chunk_imm`): one work request, one send and one receive completion per run where it does not wrap.
        With arrival words each chunk is its data WRITE and its arrival word's. A WRITE that holds the
        ``signal_every``-th chunk of a QP, and the last of each chain, are signalled; a peer that has no room for
        the rest starts (or checks) the stall's clock. Returns whether any chunk went."""
        S, every, arrival, trace = self.slots, self.signal_every, self.arrival_words, self.trace
        end = min(ready, credit + S)
        l0, C, window, merge = self._w_len + p * S, self.slot_bytes, self.max_chunks_per_qp, self._merge_runs
        pick, get = self._pick, batches.get
        chains = []         # (QP, its chain) of this peer in this sweep
        seq = st.next_post
        if end - seq > 1:   # (a burst: runs of ceil(m / r) chunks; one chunk: a run of one)
            r = sum(len(room) for room, _ in picks)
            run = min(MAX_RUN, -(-(end - seq) // r)) if r else 1
        else:
            run = 1
        while seq < end:
            q = pick(picks)
            if q is None:
                break
            batch = get((p, q.qp))
            if batch is None:
                batch = batches[(p, q.qp)] = []
                chains.append((q, batch))
            first, inflight, nbytes = seq, q.inflight, 0
            stop = min(end, seq + run, seq + window - len(inflight))
            if not inflight:
                self._busy_qps.add(q)
            seg, seg_bytes, seg_sig = seq % S, 0, False     # the WRITE being merged: its first slot, bytes, signal
            while seq < stop:
                k = seq % S
                n = words[l0 + k]
                if not 0 < n <= C:
                    self._chunk_len(p, q, seq, words)       # (raises)
                nbytes += n
                inflight.append((seq, n, now))
                q.unsignaled += 1
                if q.unsignaled >= every:
                    q.unsignaled = 0
                    seg_sig = True
                if arrival:     # the data, then the arrival word seq + 1 from its ASRC word (_signal_op)
                    self.flags.w[self.flags.asrc_index(p, seq)] = seq + 1
                    data_key, word_key = self._arrival_keys[k]
                    batch.append((data_key, n, 0, None, False))
                    batch.append((word_key, 8, 0, TAG_CHUNK | (seq & _SEQ_MASK), seg_sig))
                    q.wrs += 2
                    seg_sig = False
                elif seq + 1 == stop:   # the run's last: its WRITE_WITH_IMM carries the run's signal
                    batch.append((seg, seg_bytes + n, (seq - first) << IMM_SEQ_BITS | (seq & IMM_SEQ_MASK),
                                  TAG_CHUNK | (seq & _SEQ_MASK), seg_sig))
                    q.wrs += 1
                elif n < C or k == S - 1 or not merge or seg_bytes + n + C > MAX_WRITE_BYTES:
                    # (a partial chunk, the ring's end or a WRITE's most bytes ends it)
                    batch.append(((0, seg), seg_bytes + n, 0, TAG_CHUNK | (seq & _SEQ_MASK), seg_sig))
                    q.wrs += 1
                    seg, seg_bytes, seg_sig = (k + 1) % S, 0, False
                else:           # a full chunk followed by the next slot's: one WRITE carries both
                    seg_bytes += n
                if trace:
                    self._event("post", p, q.channel, q.qp, seq, n)
                seq += 1
            # the run's bytes count as posted on its QP and port (what _account does per chunk, once per run)
            q.out_bytes += nbytes
            q.total_bytes += nbytes
            q.chunks += seq - first
            port = q.port_w
            port[0] += nbytes
            port[1] += nbytes
            if len(inflight) >= window:     # (_room: its window is full)
                self._room(q)
        st.next_post = seq
        for q, batch in chains:     # each chain's last chunk is signalled
            last = batch[-1]
            if not last[4]:
                batch[-1] = last[:4] + (True,)
                q.unsignaled = 0
        if seq < ready and seq - credit >= S:
            self._stalled(p, st, credit, now)
        else:
            st.stall_since = None
        return bool(chains)

    def _place(self, p: int, st: _PeerState, picks, end: int, now: float,
               words: list) -> Dict[_QPState, List[Tuple[int, int]]]:
        """:meth:`_place_prepared` for ``Op``s: returns per QP its ``(seq, length)`` in order, for :meth:`_chain_ops`.
        Raises :class:`ProxyError` on a chunk length outside ``1..slot_bytes``."""
        chains: Dict[_QPState, List[Tuple[int, int]]] = {}
        while st.next_post < end:
            q = self._pick(picks)
            if q is None:
                break
            seq = st.next_post
            n = self._chunk_len(p, q, seq, words)
            chains.setdefault(q, []).append((seq, n))
            self._account(q, seq, n, now)
            st.next_post = seq + 1
        return chains

    def _stalled(self, p: int, st: _PeerState, credit: int, now: float) -> None:
        """Peer ``p`` has ready chunks beyond the ``credit`` it consumed plus the ring's slots: start the clock of that
        wait, or raise :class:`ProxyError` once it is over ``timeout_s``."""
        st.stall_since = st.stall_since or now
        if now - st.stall_since > self.timeout_s:
            raise ProxyError(self.rank, p, None, None, STAGE_NAMES[STAGE_CREDIT],
                             f"chunk {st.next_post} has had no room at the peer for {self.timeout_s:g} s "
                             f"(it consumed {credit} chunks)")

    def _chain_ops(self, p: int, chains: Dict[_QPState, List[Tuple[int, int]]],
                   batches: Dict[Tuple[int, int], list]) -> None:
        """Append the ``Op``s of ``chains`` (:meth:`_place`) to ``batches`` per ``(peer, QP)``, every
        ``signal_every``-th and each chain's last signalled (a test hook replaced :meth:`_chunk_ops`, or chunks of
        several WRITEs)."""
        # chunks of one WRITE skip _chunk_ops + _fold_signal, unless a test hook replaced _chunk_ops
        fast = (self.wr_bytes >= self.slot_bytes and not self.arrival_words
                and getattr(self._chunk_ops, "__func__", None) is _CHUNK_OPS)
        every = self.signal_every
        for q, seqs in chains.items():
            qp = q.qp
            last = len(seqs) - 1
            for i, (seq, n) in enumerate(seqs):
                q.unsignaled += 1
                sig = q.unsignaled >= every or i == last
                if sig:
                    q.unsignaled = 0
                if fast:        # one WRITE carrying the signal: what _fold_signal makes of _chunk_ops' two
                    batches.setdefault((p, qp), []).append(self._signal_op(p, seq, n, sig))
                    q.wrs += 1
                    if self.trace:
                        self._event("post", p, q.channel, qp, seq, n)
                    continue
                for tqp, op in _fold_signal(self._chunk_ops(p, qp, seq, n, sig)):
                    batches.setdefault((p, tqp), []).append(op)
                    q.wrs += 1
                    if tqp != qp and is_chunk_signal(op):   # the signal went elsewhere: retire it there
                        ent = next(e for e in q.inflight if e[0] == seq)
                        q.inflight.remove(ent)
                        self._room(q)           # (its window may have room again)
                        to = self._qps[(p, tqp)]
                        to.inflight.append(ent)
                        to.inflight = collections.deque(sorted(to.inflight))
                        self._room(to)
                        self._busy_qps.add(to)
                if self.trace:
                    self._event("post", p, q.channel, qp, seq, n)

    def _account(self, q: _QPState, seq: int, n: int, now: float) -> None:
        """Chunk ``seq`` of ``n`` bytes goes on ``q``: its bytes count as posted there and on its port."""
        q.out_bytes += n
        q.total_bytes += n
        q.chunks += 1
        port = q.port_w
        port[0] += n
        port[1] += n
        inflight = q.inflight
        if not inflight:
            self._busy_qps.add(q)
        inflight.append((seq, n, now))   # moved to the signal's QP where that is another one
        if len(inflight) >= self.max_chunks_per_qp:     # (_room: its window is full)
            self._room(q)

    def _chunk_ops(self, peer: int, qp: int, seq: int, nbytes: int, signaled: bool) -> List[Tuple[int, Op]]:
        """The work requests of one chunk, as ``(QP index, Op)``: its WRITEs, then its signal (a zero-length
        WRITE_WITH_IMM with the chunk number as immediate), all on QP ``qp``; the caller folds the signal into the
        last WRITE where both are on one QP (:func:`_fold_signal`).

        A documented test hook: the ordering tests subclass the scheduler and override this method to post the
        signal on another QP (the planted bug in-QP ordering exists to prevent), and check that their
        property fails; every QP index returned must be below ``num_qps_per_peer``. While it is not replaced (on
        the instance, the class or in a subclass: ``testing.drop_rdma_signal``, the ordering and fault tests), a
        chunk of one WRITE (``wr_bytes`` at least ``slot_bytes``, the default) is built directly as the folded
        WRITE_WITH_IMM, without calling it (the same work request, a few µs less of the proxy's Python)."""
        lay, rem = self.layout, self._remote[peer]
        src, dst = lay.send_off(peer, seq), lay.recv_off(self.rank, seq)
        ops = [(qp, Op(WRITE, self.region, src + o, min(self.wr_bytes, nbytes - o), rem, dst + o))
               for o in range(0, nbytes, self.wr_bytes)]
        ops.append((qp, self._signal_op(peer, seq, 0, signaled)))
        return ops

    def _signal_op(self, peer: int, seq: int, nbytes: int, signaled: bool) -> Op:
        """Chunk ``seq``'s signal to ``peer``: a WRITE_WITH_IMM of the first ``nbytes`` of its slot (0: the
        zero-length signal of :meth:`_chunk_ops`; the chunk's length: the whole chunk as one work request), the
        chunk number as immediate and in ``wr_id``. With arrival words (``nbytes`` 0): the WRITE of the arrival word
        ``seq + 1`` from its ``ASRC`` word into the peer's ``ARRIVE`` word of the slot (``wr_id`` as above)."""
        lay = self.layout
        if self.arrival_words and not nbytes:
            # The NIC reads the source word when it executes the WRITE, after this returns. It is rewritten only
            # for chunk seq + slots, which goes once the peer's credit passed seq: the peer consumed chunk seq, so
            # it saw this word land, so the NIC had read it.
            i = self.flags.asrc_index(peer, seq)
            self.flags.w[i] = seq + 1
            return Op(WRITE, self.region, 8 * i, 8, self._remote[peer], self._arrive_off[seq % self.slots],
                      signaled=signaled, wr_id=TAG_CHUNK | (seq & _SEQ_MASK))
        return Op(WRITE_WITH_IMM, self.region, lay.send_off(peer, seq), nbytes, self._remote[peer],
                  lay.recv_off(self.rank, seq), imm=chunk_imm(seq), signaled=signaled,
                  wr_id=TAG_CHUNK | (seq & _SEQ_MASK))

    def _credit(self, p: int, head: int) -> bool:
        """Send ``head`` (``HEAD[p]`` as the sweep read it; for a masked peer, whose chunks nothing consumes, the
        chunks that arrived) to ``p``'s ``CREDIT[me]`` when half a ring was freed or the consumer caught up. A
        peer that masked this rank (and was not masked here) so never stalls for credit: its chunks land and
        are discarded until its own kernels mask this rank."""
        st = self._peer[p]
        if head <= st.credit_sent or (head - st.credit_sent < self._credit_every and head < st.tail):
            return False
        self.flags.w[self._i_src[p]] = head
        wall, split = time.perf_counter_ns, self._cpu_split
        t0, c0 = wall(), (time.thread_time_ns() if split else 0)       # (_tx_begin / _tx_done, inline)
        try:        # (the WRITE of SRC[p] into the peer's CREDIT[me], prepared at start)
            self.t.post_prepared(p, 0, _CREDIT_REQ)
        except Exception as ex:   # noqa: BLE001
            raise ProxyError(self.rank, p, 0, 0, STAGE_NAMES[STAGE_POST], f"credit write: {type(ex).__name__}: {ex}") from ex
        finally:
            if split:
                self._sweep_tx_cpu_ns += time.thread_time_ns() - c0
            self._sweep_tx_ns += wall() - t0
        self.wrs_posted += 1
        st.credit_sent = head
        return True

    def _tell_gave_up(self, p: int, st) -> bool:
        """Low-latency rank masking across hosts: once this rank's kernels gave up on the masked peer ``p``
        (``GSRC[p]``: the call they gave up in, stored before ``MASKED[p]``), WRITE that word into ``p``'s ``GAVE[me]``
        (once, QP 0, unsignalled), so that ``p``'s kernels mask this rank at their next wait for it instead of taking
        this rank's chunk of that call, or the silence after it, as one of their calls'. Nothing for a peer masked
        by hand (no ``GSRC``). A failed post is not an error: the peer is masked (a dead one's QPs may fail).
        Returns whether it posted."""
        g = self.flags.gave_up_on(p)
        if g == 0:
            return False
        st.gave_told = g
        try:
            self.t.post(p, 0, [Op(WRITE, self.region, 8 * self.flags.gsrc_index(p), 8, self._remote[p],
                                  8 * F.ring_gave_word.host(self.world, self.slots, self.rank))])
        except Exception:   # noqa: BLE001 - a masked peer: nothing waits for it
            return False
        self.wrs_posted += 1
        return True


#: the order of a port's QPs for the picker (:meth:`ChunkPosting._pick`): least outstanding bytes, least bytes so far,
#: lowest QP index
_QP_ORDER = operator.attrgetter("out_bytes", "total_bytes", "qp")
#: the scheduler's own ``_chunk_ops`` (a chunk skips it only while nothing replaced it: the ordering tests do)
_CHUNK_OPS = ChunkPosting._chunk_ops
#: the prepared credit WRITE's key (QP 0 of each peer) and its post: 8 bytes, unsignalled
_CREDIT_KEY = "credit"
_CREDIT_REQ = ((_CREDIT_KEY, 8, 0, None, False),)


def _fold_signal(ops: List[Tuple[int, Op]]) -> List[Tuple[int, Op]]:
    """A chunk's work requests with its signal folded into its last WRITE where both go on the same QP: that
    WRITE becomes the WRITE_WITH_IMM (same bytes, the signal's immediate, completion request and ``wr_id``), one
    work request fewer. In-QP ordering is unchanged: the immediate's receive completion still says that every
    byte before it on the QP, its own included, is placed (the verbs spec's WRITE_WITH_IMM carries data). A
    signal on another QP than the data (the ordering tests' planted bug), or a chunk without one, is left as
    it is."""
    if len(ops) < 2:
        return ops
    (qs, sig), (qw, last) = ops[-1], ops[-2]
    if sig.kind != WRITE_WITH_IMM or sig.length or last.kind != WRITE or qs != qw:
        return ops
    folded = Op(WRITE_WITH_IMM, last.region, last.offset, last.length, last.remote, last.remote_offset,
                imm=sig.imm, signaled=sig.signaled, wr_id=sig.wr_id)
    return ops[:-2] + [(qw, folded)]
