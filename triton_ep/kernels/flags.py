"""Device-side flags: the words kernels release and acquire to signal each other across ranks.

Word offsets and codes live in :mod:`triton_ep.protocol.signal_header` (imported here for the kernels):
``tl.constexpr`` that kernels read as constants and host code takes ``int()`` of; the per-peer arrays'
offsets are the protocol's formulas (``off_*``), which kernels call and host code evaluates with ``.host``.

Every rank's shared buffer starts with a *signal header* of int64 words (laid out in the protocol). A kernel on
rank ``s`` writes into rank ``d``'s header through the same peer mapping it writes data through
(``hdr + hdr_delta[d]``); a kernel reads its own header locally. Round numbers grow by one for every
transfer round any collective of the Buffer runs, identically on every rank, and live in device memory
(``W_BASE``): a graph replay advances them as a live call does.

Protocol of round ``n`` (every collective round: a *send* launch, then a *receive* launch):

- the send launch waits until every peer ``d`` has consumed round ``n - 1`` out of its area
  (``d.CONSUMED >= n - 1``), writes its data into the peers' areas, and its last program stores its call
  signature into ``d.SIG[s]`` and then releases ``d.READY[s] = n``;
- the receive launch waits for ``READY[s] >= n`` from every peer, compares ``SIG[s]`` with its own, moves
  the rows out, and its last program releases ``CONSUMED = n`` (and, in the call's last round, advances
  ``BASE`` by the call's rounds).

No program waits for a program of its own launch (Triton's interpreter runs them one after another),
and a send of round ``n`` waits only for receives of round ``n - 1``, which each rank launches before
its send of round ``n``: there is no wait cycle. The exception is a *fused* launch (a call of all its rounds as
one launch: :func:`wait_own_send` between the send and receive parts of a round, the receive counted at
``W_DONE2``, and :func:`wait_own_consumed` between a round's receive part and the next round's send part), whose
grid is capped so that all its programs are resident at once (one program under the interpreter).

Launches skip the end-of-launch count where the next launch in the stream can act instead, as it starts only
once the launch before it has completed. Normal mode, where ranks run concurrently (``signals["defer"]``: not the
lock-step runner): a split send records its round (``NEXT``, :func:`defer_send`), the receive right after it
publishes it (:func:`publish_deferred`) and records the freed area (``PENDC``, :func:`defer_recv`), which the
rank's next send releases into ``CONSUMED`` (:func:`release_consumed`). Low-latency calls (the ``L_*`` words): a
receive's ``CONS`` is released by the rank's next low-latency launch (:func:`.ll_flags.ll_finish_recv`), and in a call
without a receive hook, within one host, the receive launch publishes its own call's ``READY``
(:func:`.ll_flags.ll_publish_deferred`). Then the programs of a receive may wait for program (0, 0) of a peer's receive of
the same round or call (where that peer deferred too), which publishes before it waits; the GPU places a
launch's programs in order (not a documented guarantee, but what persistent kernels rely on), so that program is
among the first to run, and where ranks share a GPU their grids are capped (``max_programs``) so that spinning
programs of one rank never keep another's from starting.

Every wait is bounded. On GPU a wait reads ``%globaltimer`` and gives up after ``timeout_ns``; under the
interpreter (no clock) a host watchdog sets the host block's abort word. A wait also ends when the
awaited peer says it failed (``FAILED[s]``) or gave up (``GONE[s]``), or when the host saw its process gone
(``DEAD[s]`` in the host block, set by the liveness watcher; read every spin under the interpreter, every
:data:`DEAD_LOOK` looks on GPU, where it is a read of host memory). On GPU a wait reads its flag alone
:data:`SPIN_BURST` times in a row between its looks at those words. A wait that ends badly writes an
*error record* into the host-visible block (first error wins), marks the local header (``W_ERR``) and
tells every peer (``FAILED[me]`` or ``GONE[me]`` in their headers). Once ``W_ERR`` is set, later launches
skip their waits and move nothing until the host re-synchronises the group.
"""
import triton
import triton.language as tl

from ..protocol.signal_header import (  # noqa: F401 - the words, re-exported for the kernels
    W_BASE, W_CONSUMED, W_DONE, W_DONE2, W_ERR, W_PENDC, W_NEXT, W_FIXED, off_ready, off_sig, off_failed, off_gone,
    off_nflag, off_notify,
    NOTIFY_E_WORDS, off_notify_e, header_words, H_ABORT, H_LOCK, H_KIND, H_PEER, H_STAGE, H_CALL, H_INFO,
    H_INFO2, H_WORDS, H_DEAD, E_TIMEOUT, E_GONE, E_FAILED, E_MISMATCH, E_BADIDS, E_CAPACITY, E_BADCOUNTS,
    STAGE_DISPATCH_SEND, STAGE_DISPATCH_RECV, STAGE_COMBINE_SEND, STAGE_COMBINE_RECV, STAGE_NOTIFY, STAGE_HOST,
    STAGE_FAILED, STAGE_LL_DISPATCH_SEND, STAGE_LL_DISPATCH_RECV, STAGE_LL_COMBINE_SEND, STAGE_LL_COMBINE_RECV,
    LL_ROOT_BITS, LL_ROOT_MASK, LL_CALL_SHIFT,
    L_SEQ, L_DONE, L_CONS, L_UNPACKED, L_PEND, L_NEXT, L_DONE2, L_GATE, L_FIXED, off_ll_ready, off_ll_sig, off_ll_mask,
    off_ll_failed, off_ll_gaveup, LL_MASK_HAND, LL_MASK_WAIT, LL_SIG_MASKED,
    off_ll_tx, off_ll_rx, ll_ctl_words,
    RING_ABORT, RING_ERR_KIND, RING_ERR_PEER, RING_ERR_STAGE, RING_ERR_SEQ, RING_FIXED, RING_READY, RING_SENT,
    RING_TAIL, RING_HEAD, RING_CREDIT, RING_FAULT, RING_SRC, RING_LEN, STAGE_RING_PRODUCE, STAGE_RING_CONSUME,
    ring_word, ring_len_word, ring_masked_word, ring_arrive_word, ring_asrc_word, ring_gave_word, ring_gsrc_word,
    ring_ctrl_words, STAGE_NAMES)


#: a GPU wait reads the awaited flag alone this many times in a row between its looks at the other words (the
#: peer's header words, the clock, the host's ``DEAD`` word, the proxy's abort word). On one H100 (2026-12-06, a
#: fused T 1024 cached dispatch at one rank, 132 programs of which 131 waited for the last one's release) those
#: looks on every spin made the release 500-700 µs late and the waiters see it up to 500 µs apart: 1100 µs per call
#: against 25 with the flag alone
SPIN_BURST = tl.constexpr(64)
#: a GPU wait reads the host's ``DEAD`` word of the awaited peer (host memory) once in this many looks (a power of
#: two)
DEAD_LOOK = tl.constexpr(4)


@triton.jit
def failure_word(round_no, kind):
    """The ``FAILED`` word for a failure of kind ``kind`` in round ``round_no`` (kinds are < 8)."""
    return round_no.to(tl.int64) * 8 + kind


@triton.jit
def ll_failure_word(lcall, kind, root):
    """The ``LFAILED`` word for a failure of kind ``kind`` (< 8) in low-latency call ``lcall``, first on rank
    ``root`` (the protocol's ``ll_failure_word_of``)."""
    zero = tl.full([], 0, tl.int64)
    return (((zero + lcall) << LL_ROOT_BITS) | ((zero + root) & LL_ROOT_MASK)) * 8 + kind


@triton.jit
def ll_failure_call(w):
    """The low-latency call an ``LFAILED`` word names (the protocol's ``ll_failure_call``)."""
    return w >> LL_CALL_SHIFT


@triton.jit
def ll_failure_root(w):
    """The rank that failed first, of an ``LFAILED`` word (the protocol's ``ll_failure_root``)."""
    return (w >> 3) & LL_ROOT_MASK


@triton.jit
def now_ns(USE_CLOCK: tl.constexpr):
    """GPU global timer in nanoseconds; 0 under the interpreter (which has no clock)."""
    if USE_CLOCK:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def fence_all_threads(USE_ASM: tl.constexpr):
    """A system-scope fence in every thread of the program (GPU; a no-op under the interpreter, whose
    programs run one after another): orders this thread's earlier stores before a later release."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, $1;", "=r,r", [tl.arange(0, 1024)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def acquire(ptr):
    """Read an int64 flag with acquire semantics at system scope."""
    return tl.atomic_add(ptr, tl.full([], 0, tl.int64), sem="acquire", scope="sys")


@triton.jit
def release(ptr, value):
    """Store an int64 flag with release semantics at system scope."""
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def post_error(hdr, hdr_delta, host, kind, peer, stage, call, me, R: tl.constexpr, ctl=None, lcall=-1):
    """Record an error (first one wins), mark this rank's header and tell every peer: ``GONE[me]`` after
    a timeout (this rank leaves the group), else ``FAILED[me]`` tagged with round ``call`` or, for a
    low-latency call (``ctl``: this rank's low-latency control block), ``LFAILED[me]`` naming ``lcall`` in the
    peers' control blocks (the low-latency call it failed: their earlier calls are not affected). A low-latency
    failure that ``peer``'s own ``LFAILED`` word for ``lcall`` caused is recorded, and passed on, as the failure of
    that word's root (the rank that failed first, not a host mate that relayed it); any other names ``peer`` in
    the record and this rank as the root."""
    zero = tl.full([], 0, tl.int64)
    kind, peer, stage, call = zero + kind, zero + peer, zero + stage, zero + call
    root, named = zero + me, peer
    if ctl is not None:
        w = tl.load(ctl + off_ll_failed(R) + peer, volatile=True)
        relayed = (peer != me) & ((w & 7) != 0) & (ll_failure_call(w) == lcall)
        root = tl.where(relayed, ll_failure_root(w), root)
        named = tl.where(relayed, root, peer)
    if tl.atomic_cas(host + H_LOCK, zero, zero + 1, sem="acq_rel", scope="sys") == 0:
        tl.store(host + H_PEER, named)
        tl.store(host + H_STAGE, stage)
        tl.store(host + H_CALL, call)
        release(host + H_KIND, kind)
    release(hdr + W_ERR, kind)
    for r in tl.static_range(R):
        if r != me:
            if kind == E_TIMEOUT:
                release(hdr + tl.load(hdr_delta + r) + off_gone(R) + me, stage + 1)
            elif ctl is not None:       # the low-latency call, and whether this rank found a mismatch
                release(ctl + tl.load(hdr_delta + r) + off_ll_failed(R) + me,
                        ll_failure_word(lcall, tl.where(kind == E_MISMATCH, E_MISMATCH, E_FAILED), root))
            else:       # a mismatch stays a mismatch where the peer reads it; anything else: "failed"
                release(hdr + tl.load(hdr_delta + r) + off_failed(R) + me,
                        failure_word(call, tl.where(kind == E_MISMATCH, E_MISMATCH, E_FAILED)))


@triton.jit
def _peer_status(hdr, peer, rnd, R: tl.constexpr):
    """``E_GONE``, ``E_MISMATCH`` or ``E_FAILED`` when ``peer`` said so in this rank's header for a round
    up to ``rnd`` (the round being waited for), else 0."""
    gone = tl.load(hdr + off_gone(R) + peer, volatile=True)
    failed = tl.load(hdr + off_failed(R) + peer, volatile=True)
    # a failure word counts only for this call: its round is past the rounds this rank has completed
    # (words of earlier calls, or posted late across a re-synchronisation, are ignored) and not past the
    # awaited round (a peer that finished this call and failed its next one says nothing about this one)
    f = failed >> 3
    kind = tl.where((f > tl.load(hdr + W_BASE, volatile=True)) & (f <= rnd), failed & 7, 0)
    return tl.where(gone != 0, E_GONE, kind).to(tl.int32)


@triton.jit
def _ll_failed(status, fail_ptr, fail_call):
    """``status``, or (when 0) the kind in the peer's ``LFAILED`` word when it names call ``fail_call``."""
    w = tl.load(fail_ptr, volatile=True)
    return tl.where((status == 0) & (ll_failure_call(w) == fail_call), (w & 7).to(tl.int32), status)


@triton.jit
def wait_at_least(flag, want, hdr, host, peer, rnd, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr,
                  fail_ptr=None, fail_call=-1, ready=None, abort=None, gave_ptr=None):
    """Spin until ``*flag >= want`` (acquire), for round ``rnd``. Returns 0, or the error kind that ended
    the wait:

    - the peer's ``GONE``/``FAILED`` word in this rank's header (looked at first: a peer that left or
      failed the call is not waited for, even where its flag already moved);
    - with ``fail_ptr``, the kind (``E_FAILED`` or ``E_MISMATCH``) of ``*fail_ptr`` when it names low-latency
      call ``fail_call`` (a call the peer rejected, or found its peers disagree on);
    - with ``ready``, ``E_MISMATCH`` when the peer released ``*ready >= want`` before the flag (a
      dispatch's ``NOTIFIED`` comes before anything it sends of that round: a peer that sends first runs
      another collective);
    - the bound (``%globaltimer`` on GPU, the host watchdog's abort word under the interpreter);
    - ``E_GONE`` when the host saw the peer's process gone (its ``DEAD`` word in ``host``) and the flag is still
      short (a peer that finished its part before it died is not waited for anyway);
    - with ``abort`` (the RDMA proxy's abort word, ``RING_ABORT`` of its control block: low-latency mode across
      hosts), ``E_FAILED`` when it is set (this rank's proxy failed: nothing more arrives or leaves through it) and the
      flag is still short. Read where the ``DEAD`` word is (every spin under the interpreter, every
      :data:`DEAD_LOOK` looks on GPU); without ``abort`` the wait reads nothing more;
    - with ``gave_ptr`` (rank masking: the peer's ``GAVEUP`` word in this rank's low-latency control block),
      ``E_GONE`` when it names a call up to ``fail_call`` (the peer gave up on this rank then: a flag it released
      since, or before in the call it gave up on, is not this call's). Read at every look while the flag is short,
      and once more after the flag was acquired (a peer releases the word before any later flag: one load on the
      path where the flag is already there).

    On GPU the wait reads the flag alone :data:`SPIN_BURST` times in a row between its looks at these words.
    """
    status = _peer_status(hdr, peer, rnd, R)
    if fail_ptr is not None:
        status = _ll_failed(status, fail_ptr, fail_call)
    v = acquire(flag)
    t0 = now_ns(USE_CLOCK)
    looks = tl.full([], 0, tl.int32)
    while (v < want) & (status == 0):
        v = _burst(flag, v, want, USE_CLOCK)
        if v < want:
            status = _peer_status(hdr, peer, rnd, R)
            if fail_ptr is not None:
                status = _ll_failed(status, fail_ptr, fail_call)
            if ready is not None:
                if acquire(ready) >= want:
                    if acquire(flag) < want:        # read again: a notifying peer released the flag before READY
                        status = tl.maximum(status, E_MISMATCH)
            if USE_CLOCK:
                if now_ns(USE_CLOCK) - t0 > timeout_ns:
                    status = tl.maximum(status, E_TIMEOUT)
                look = (looks & (DEAD_LOOK - 1)) == 0
            else:
                if tl.load(host + H_ABORT, volatile=True) != 0:
                    status = tl.maximum(status, E_TIMEOUT)
                look = looks >= 0
            looks += 1
            if look & (status == 0):
                if tl.load(host + H_DEAD + peer, volatile=True) != 0:
                    if acquire(flag) < want:
                        status = tl.full([], E_GONE, tl.int32)
                if abort is not None:
                    if (status == 0) & (tl.load(abort, volatile=True) != 0):
                        if acquire(flag) < want:
                            status = tl.full([], E_FAILED, tl.int32)
            if gave_ptr is not None:
                status = _gave_up(status, gave_ptr, fail_call)
            v = acquire(flag)
    if gave_ptr is not None:        # (after the flag's acquire: a give-up released before it is seen)
        status = _gave_up(status, gave_ptr, fail_call)
    return status


@triton.jit
def _gave_up(status, gave_ptr, fail_call):
    """``status``, or (when 0) ``E_GONE`` when the peer's ``GAVEUP`` word at ``gave_ptr`` names a call up to
    ``fail_call`` (it gave up on this rank in that call)."""
    w = tl.load(gave_ptr, volatile=True)
    return tl.where((status == 0) & (w != 0) & (w <= fail_call), E_GONE, status).to(tl.int32)


@triton.jit
def _burst(flag, v, want, USE_CLOCK: tl.constexpr):
    """``v`` (``*flag`` as last read), or on GPU the flag read again (acquire) up to :data:`SPIN_BURST` times in a
    row while it is short of ``want``: a wait's looks at its other words come once per burst."""
    if USE_CLOCK:
        n = tl.full([], 0, tl.int32)
        while (v < want) & (n < SPIN_BURST):
            v = acquire(flag)
            n += 1
    return v


@triton.jit
def wait_peers_consumed(hdr, hdr_delta, host, want, me, stage, call, timeout_ns, R: tl.constexpr,
                        USE_CLOCK: tl.constexpr):
    """Send side of a round: wait until every peer has moved round ``want`` out of its area (it is free
    to be written). Returns True when the program may move data."""
    bad = (tl.load(hdr + W_ERR, volatile=True) != 0).to(tl.int32)
    for r in tl.static_range(R):
        if (bad == 0) & (r != me):
            st = wait_at_least(hdr + tl.load(hdr_delta + r) + W_CONSUMED, want, hdr, host, r, want + 1, timeout_ns,
                               R, USE_CLOCK)
            if st != 0:
                post_wait_error(hdr, hdr_delta, host, st, r, stage, call, me, R)
            bad = bad + st
    return bad == 0


@triton.jit
def wait_peers_ready(hdr, hdr_delta, host, want, sig, me, stage, call, timeout_ns, R: tl.constexpr,
                     USE_CLOCK: tl.constexpr):
    """Receive side of a round: wait for ``READY[s] >= want`` from every peer and check each one's call
    signature against ``sig``. Returns True when the program may move data."""
    bad = (tl.load(hdr + W_ERR, volatile=True) != 0).to(tl.int32)
    for r in tl.static_range(R):
        if (bad == 0) & (r != me):
            st = wait_at_least(hdr + off_ready(R) + r, want, hdr, host, r, want, timeout_ns, R, USE_CLOCK)
            # a peer whose part arrived with another signature called another operation (it may also
            # have said it failed: having found the same mismatch first); that is the error to name
            arrived = (st == 0) | ((st == E_FAILED) & (acquire(hdr + off_ready(R) + r) >= want))
            if arrived & (tl.load(hdr + off_sig(R) + r, volatile=True) != sig):
                st = tl.full([], E_MISMATCH, tl.int32)
            if st != 0:
                post_wait_error(hdr, hdr_delta, host, st, r, stage, call, me, R)
            bad = bad + st
    return bad == 0


@triton.jit
def post_wait_error(hdr, hdr_delta, host, st, peer, stage, call, me, R: tl.constexpr, ctl=None, lcall=-1):
    """A wait for ``peer`` ended with status ``st``: record it (``ctl``, ``lcall``: as :func:`post_error`).
    For a peer that gave up, the record names the peer's own stage (from its ``GONE`` word); for a peer whose
    process is gone (``DEAD``: no ``GONE`` word), this wait's ``stage``."""
    gone_stage = tl.load(hdr + off_gone(R) + peer, volatile=True) - 1
    post_error(hdr, hdr_delta, host, st, peer, tl.where((st == E_GONE) & (gone_stage >= 0), gone_stage, stage), call,
               me, R, ctl, lcall)


@triton.jit
def last_program(hdr, USE_ASM: tl.constexpr):
    """Count this program as finished; True in the launch's last program to finish (which then resets
    the counter). Every earlier program's stores are ordered before the count it adds."""
    return last_program_at(hdr + W_DONE, USE_ASM)


@triton.jit
def last_program_at(counter, USE_ASM: tl.constexpr):
    """:func:`last_program` over the launch counter word ``counter``.

    The program's threads meet at a barrier, then one thread adds to the counter with a system-scope
    acquire-release atomic: a release is cumulative over what the barrier ordered before it (the PTX
    memory model's causality order includes ``bar.sync``), so every thread's earlier stores, to this GPU or
    a peer's, are ordered before the count, and the last program's acquire orders them before its own
    later releases. (One system-scope operation per program: with a fence in every thread before the count
    instead, a graph replay of low-latency dispatch + combine took 86 us on an H200, against 51 us so.)"""
    tl.debug_barrier()
    n = tl.num_programs(0) * tl.num_programs(1)
    done = tl.atomic_add(counter, tl.full([], 1, tl.int64), sem="acq_rel", scope="sys")
    last = done == n - 1
    if last:
        tl.store(counter, tl.full([], 0, tl.int64))
    return last


@triton.jit
def first_program():
    """Program (0, 0) of the launch: the one that acts for a launch without an end-of-launch count."""
    return (tl.program_id(0) == 0) & (tl.program_id(1) == 0)


@triton.jit
def release_pending(flag, pending):
    """Release ``*flag = *pending`` where the flag is behind (a receive recorded ``*pending`` and left its release to
    the next launch, which calls this)."""
    p = tl.load(pending)
    if p > tl.load(flag):
        release(flag, p)


@triton.jit
def finish_send(hdr, hdr_delta, round_no, sig, me, R: tl.constexpr, USE_ASM: tl.constexpr):
    """End of a send launch: the last program publishes the call signature and ``READY[me] = round_no``
    in every peer's header (unless this rank holds an error: then peers learn it from ``FAILED``)."""
    if last_program(hdr, USE_ASM):
        if tl.load(hdr + W_ERR, volatile=True) == 0:
            _release_ready(hdr, hdr_delta, round_no, sig, me, R)


@triton.jit
def _release_ready(hdr, hdr_delta, round_no, sig, me, R: tl.constexpr):
    """Store the call signature into every rank's ``SIG[me]``, then release ``READY[me] = round_no`` there."""
    for r in tl.static_range(R):
        peer = hdr + tl.load(hdr_delta + r)
        tl.store(peer + off_sig(R) + me, sig)
        release(peer + off_ready(R) + me, round_no)


@triton.jit
def finish_send_fused(hdr, hdr_delta, round_no, sig, me, R: tl.constexpr, USE_ASM: tl.constexpr):
    """:func:`finish_send` at the end of a fused launch's send part. The last program also releases this rank's own
    ``READY[me] = round_no`` when this rank holds an error (only :func:`wait_own_send` reads that word), so the
    launch's other programs never wait for a release that would not come (an error posted by one program after
    another had read ``W_ERR`` and begun to wait)."""
    if last_program(hdr, USE_ASM):
        if tl.load(hdr + W_ERR, volatile=True) == 0:
            _release_ready(hdr, hdr_delta, round_no, sig, me, R)
        else:
            release(hdr + off_ready(R) + me, round_no)


@triton.jit
def finish_recv(hdr, round_no, advance, USE_ASM: tl.constexpr):
    """End of a receive launch: the last program releases ``CONSUMED = round_no`` (this rank's area is
    free again) and advances ``BASE`` by ``advance`` (the call's rounds, in its last round; else 0)."""
    finish_recv_at(hdr, hdr + W_DONE, round_no, advance, USE_ASM)


@triton.jit
def release_consumed(hdr):
    """First thing of a send launch (split or fused) and of a notify launch, in program (0, 0), before any wait:
    release ``CONSUMED = PENDC`` where the last receive launch, which had no end-of-launch count (:func:`defer_recv`),
    is not released yet. That receive precedes this launch in the stream, so it has completed: its reads of the
    area are done."""
    if first_program():
        release_pending(hdr + W_CONSUMED, hdr + W_PENDC)


@triton.jit
def defer_send(hdr, round_no):
    """End of a send launch without an end-of-launch count (ranks that run concurrently: not the lock-step runner):
    program (0, 0) records ``NEXT = round_no``; the receive launch right after it publishes the round
    (:func:`publish_deferred`)."""
    if first_program():
        tl.store(hdr + W_NEXT, round_no)


@triton.jit
def publish_deferred(hdr, hdr_delta, sig, me, R: tl.constexpr):
    """Start of the receive launch after a send launch without an end-of-launch count: returns the round ``n =
    NEXT``, and program (0, 0), before anything waits, publishes it as the send's last program would have
    (:func:`finish_send`: the signature and ``READY[me] = n`` in every peer, unless this rank holds an error). The
    send launch has completed (stream order), so its records are in place before the release. The peers' receive
    launches of the round wait for it and publish theirs first, in their program (0, 0) (see the module's notes)."""
    n = tl.load(hdr + W_NEXT)
    if first_program():
        if tl.load(hdr + W_ERR, volatile=True) == 0:
            _release_ready(hdr, hdr_delta, n, sig, me, R)
    return n


@triton.jit
def defer_recv(hdr, round_no, advance):
    """End of a receive launch without an end-of-launch count (one whose round came from :func:`publish_deferred`,
    so none of its programs reads ``BASE``): program (0, 0) advances ``BASE`` by ``advance`` and records ``PENDC =
    round_no``; this rank's next send launch releases ``CONSUMED`` (:func:`release_consumed`), and a peer waits for
    that only in a send of a later round."""
    if first_program():
        if advance != 0:
            tl.store(hdr + W_BASE, tl.load(hdr + W_BASE) + advance)
        tl.store(hdr + W_PENDC, round_no)


@triton.jit
def wait_own_send(hdr, hdr_delta, host, round_no, me, stage, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr):
    """In a fused send + receive launch, between its parts: wait until the send part's last program released
    ``READY[me] = round_no`` here (every program's records into this rank's own area are then visible;
    :func:`finish_send_fused` releases it even when this rank holds an error). The grid is capped at one program
    per multiprocessor so that all are resident; where they are not (SMs withheld, e.g. by MPS), the wait runs
    out and the timeout is recorded against this rank. Returns True when the program may move data."""
    return _wait_own(hdr + off_ready(R) + me, round_no, hdr, hdr_delta, host, round_no, me, stage, timeout_ns, R,
                     USE_CLOCK)


@triton.jit
def _wait_own(flag, want, hdr, hdr_delta, host, rnd, me, stage, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr):
    """A fused launch's wait for a word of this rank's own (``*flag >= want``, for round ``rnd``) unless this rank
    already holds an error; a wait that ends otherwise is posted as this rank's error. Returns True when the program
    may move data."""
    ok = tl.load(hdr + W_ERR, volatile=True) == 0
    if ok:
        st = wait_at_least(flag, want, hdr, host, me, rnd, timeout_ns, R, USE_CLOCK)
        if st != 0:
            post_error(hdr, hdr_delta, host, st, me, stage, rnd, me, R)
            ok = False
    return ok


@triton.jit
def wait_own_consumed(hdr, hdr_delta, host, round_no, me, stage, timeout_ns, R: tl.constexpr,
                      USE_CLOCK: tl.constexpr):
    """In a fused launch of several rounds, before the send part of round ``round_no + 1``: wait until the receive
    part's last program of round ``round_no`` released ``CONSUMED = round_no`` here (every program of the launch
    has then moved that round out of this rank's own area, which this rank's send writes into too, and the
    launch's W_DONE2 count has started again). :func:`finish_recv_at` releases it even when this rank holds an
    error. Every program must be resident, as for :func:`wait_own_send`. Returns True when the program may move
    data."""
    return _wait_own(hdr + W_CONSUMED, round_no, hdr, hdr_delta, host, round_no + 1, me, stage, timeout_ns, R,
                     USE_CLOCK)


@triton.jit
def wait_round_free(hdr, hdr_delta, host, round_no, own, me, stage, timeout_ns, R: tl.constexpr,
                    USE_CLOCK: tl.constexpr):
    """The send part of round ``round_no`` of a fused launch: wait until every peer has consumed round ``round_no -
    1`` (:func:`wait_peers_consumed`) and, with ``own`` (a round after the launch's first), this rank too
    (:func:`wait_own_consumed`). Returns True when the program may move data."""
    go = wait_peers_consumed(hdr, hdr_delta, host, round_no - 1, me, stage, round_no, timeout_ns, R, USE_CLOCK)
    if own:
        go = go & wait_own_consumed(hdr, hdr_delta, host, round_no - 1, me, stage, timeout_ns, R, USE_CLOCK)
    return go


@triton.jit
def finish_recv_at(hdr, counter, round_no, advance, USE_ASM: tl.constexpr):
    """:func:`finish_recv` counting the launch's programs at ``counter`` (``hdr + W_DONE2`` in a fused launch,
    whose send part counts at ``W_DONE``)."""
    if last_program_at(counter, USE_ASM):
        if advance != 0:
            tl.store(hdr + W_BASE, tl.load(hdr + W_BASE) + advance)
        release(hdr + W_CONSUMED, round_no)


@triton.jit
def wait_ge(flag, want, abort, timeout_ns, USE_CLOCK: tl.constexpr):
    """Spin until ``*flag >= want`` (acquire, system scope). Returns 0, ``E_TIMEOUT`` when the bound passed
    (``%globaltimer`` on GPU; under the interpreter the host's watchdog sets ``*abort`` to 1) or
    ``E_FAILED`` when the host set ``*abort`` to another value (the RDMA proxy failed)."""
    v = acquire(flag)
    t0 = now_ns(USE_CLOCK)
    status = tl.full([], 0, tl.int32)
    while (v < want) & (status == 0):
        v = _burst(flag, v, want, USE_CLOCK)
        if v < want:
            a = tl.load(abort, volatile=True)
            if a != 0:
                status = tl.where(a == 1, E_TIMEOUT, E_FAILED).to(tl.int32)
            if USE_CLOCK:
                if now_ns(USE_CLOCK) - t0 > timeout_ns:
                    status = tl.full([], E_TIMEOUT, tl.int32)
            v = acquire(flag)
    return status


@triton.jit
def post_ring_error(ctrl, kind, peer, stage, seq):
    """Write a ring error record (first error wins) into the control block ``ctrl``."""
    zero = tl.full([], 0, tl.int64)
    if tl.atomic_cas(ctrl + RING_ERR_PEER, zero, zero + 1 + peer, sem="acq_rel", scope="sys") == 0:
        tl.store(ctrl + RING_ERR_STAGE, zero + stage)
        tl.store(ctrl + RING_ERR_SEQ, zero + seq)
        release(ctrl + RING_ERR_KIND, zero + kind)
