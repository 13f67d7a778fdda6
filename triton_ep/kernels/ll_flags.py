"""Device-side flags of low-latency mode: the ``L_*`` words of the low-latency control block (laid out in
:mod:`triton_ep.protocol.signal_header`) that a low-latency launch waits on and releases: its peers' ``READY``
and ``CONS`` per half, the signature check, the end of a send or receive launch, the deferred publication of a
call without a receive hook, and the grid barrier of a one-launch call. The waits, error records and release and
acquire helpers they build on are normal mode's (:mod:`.flags`, whose docstring gives the protocol and the bounds);
every wait here is bounded as those are."""
import triton
import triton.language as tl

from . import flags
from .flags import (E_GONE, E_MISMATCH, E_TIMEOUT, L_CONS, L_DONE, L_DONE2, L_GATE, L_NEXT, L_PEND, L_SEQ,
                    LL_MASK_HAND, LL_MASK_WAIT, LL_SIG_MASKED, W_BASE, W_ERR, last_program_at, now_ns, off_ll_failed,
                    off_ll_gaveup, off_ll_mask, off_ll_ready, off_ll_sig, post_error, post_wait_error, release,
                    wait_at_least)


@triton.jit
def ll_wait_peers(ctl, hdr, hdr_delta, host, base, want, sig, me, stage, timeout_ns, R: tl.constexpr,
                  REMOTE: tl.constexpr, CHECK_SIG: tl.constexpr, SHRINK: tl.constexpr, USE_CLOCK: tl.constexpr,
                  COST: tl.constexpr, cost_ptr=None, cost_on=False, ahead=2, abort=None):
    """A low-latency launch waits for every peer ``r`` that is not masked (``MASK[r]`` here): with
    ``REMOTE`` until ``r``'s word ``base`` is ``>= want`` (a send: the peer has received the call that last
    used this half), else until this rank's word ``base + r`` is (a receive: ``READY``), then with
    ``CHECK_SIG`` compares ``r``'s signature (its ``SIG`` word) with ``sig``. Callers pass the flags by
    keyword.

    A wait that ends badly writes an error record (:func:`post_wait_error`; failure words are tagged
    with the normal-mode round ``W_BASE + 1``, what peers compare them with); with ``SHRINK`` a peer that
    timed out or left is masked instead and told so (:func:`ll_give_up`), and the launch goes on without it. With
    ``SHRINK`` a peer whose ``GAVEUP`` word here names this call or an earlier one (it gave up on this rank then)
    is masked so at once, without a wait (its flag, if released, is of a call it made without this rank); with
    ``SHRINK`` and ``CHECK_SIG`` a peer whose ``SIG`` is ``LL_SIG_MASKED`` (it masks this rank by hand:
    :func:`_ll_publish`) is masked here by hand (``MASK[r] = LL_MASK_HAND``: no rows of it taken, none sent to it,
    and ``low_latency_query_mask_buffer`` shows it). With
    ``COST`` and ``cost_on`` (one program of the launch) the nanoseconds spent waiting for each peer are
    added to ``cost_ptr[r]`` (0 under the interpreter, which has no clock). With ``REMOTE``, ``want + ahead``
    is the call that waits (its number goes into failure records). ``abort``: across hosts, the RDMA proxy's abort
    word (:func:`wait_at_least`; ``None`` within one host): once this rank's proxy failed the call cannot complete, so
    no wait goes on, not even for a peer of this host (which may itself wait for a chunk that will not come). Returns
    True when the program may move data (this rank holds no error)."""
    call = tl.load(hdr + W_BASE) + 1
    bad = (tl.load(hdr + W_ERR, volatile=True) != 0).to(tl.int32)
    for r in tl.static_range(R):
        masked = tl.load(ctl + off_ll_mask(R) + r, volatile=True) != 0
        if (bad == 0) & (r != me) & (masked == 0):
            if REMOTE:
                flag = ctl + tl.load(hdr_delta + r) + base
            else:
                flag = ctl + base + r
            t0 = now_ns(USE_CLOCK)
            # the low-latency call waited for: a receive waits for it (READY), a send for call - 2 (CONS; the
            # fence of a call of new sizes for call - 1: kernels.ll_fence)
            lcall = want + ahead if REMOTE else want
            # (round 0: normal-mode FAILED words are not about low-latency calls, which learn of a
            # peer's failure from LFAILED only)
            if SHRINK:      # (a peer that gave up on this rank in call lcall or before is not waited for)
                gave = ctl + off_ll_gaveup(R) + r
            else:
                gave = None
            st = wait_at_least(flag, want, hdr, host, r, 0, timeout_ns, R, USE_CLOCK,
                               ctl + off_ll_failed(R) + r, lcall, abort=abort, gave_ptr=gave)
            if COST:
                if cost_on:
                    tl.atomic_add(cost_ptr + r, now_ns(USE_CLOCK) - t0, sem="relaxed")
            if CHECK_SIG:
                theirs = tl.load(flag + (off_ll_sig(R) - off_ll_ready(R)), volatile=True)
                if SHRINK & (st == 0) & (theirs == LL_SIG_MASKED):
                    # r made this call without this rank (r masks it by hand): masked here too, by hand, from now on
                    tl.store(ctl + off_ll_mask(R) + r, tl.full([], 0, tl.int64) + LL_MASK_HAND)
                elif (st == 0) & (theirs != sig):
                    st = tl.full([], E_MISMATCH, tl.int32)
            if SHRINK & ((st == E_TIMEOUT) | (st == E_GONE)):
                ll_give_up(ctl, hdr_delta, r, lcall, me, R)
                st = tl.full([], 0, tl.int32)
            if st != 0:
                post_wait_error(hdr, hdr_delta, host, st, r, stage, call, me, R, ctl, lcall)
            bad = bad + st
    return bad == 0


@triton.jit
def ll_give_up(ctl, hdr_delta, r, lcall, me, R: tl.constexpr):
    """Rank masking: this rank gives up on rank ``r`` in its low-latency call ``lcall`` (a wait for ``r`` timed out,
    found ``r`` gone, or found ``r``'s ``GAVEUP`` word): ``MASK[r] = LL_MASK_WAIT`` here, and ``GAVEUP[me] = lcall``
    released in ``r``'s control block where it is mapped here (not a rank reached over the network, whose block
    aliases this rank's own: ``hdr_delta[r] == 0``), unless already set, so that ``r`` never takes a flag of this
    call or a later one as one of its own calls' (it masks this rank at its next wait for it)."""
    tl.store(ctl + off_ll_mask(R) + r, tl.full([], 0, tl.int64) + LL_MASK_WAIT)
    d = tl.load(hdr_delta + r)
    if d != 0:
        word = ctl + d + off_ll_gaveup(R) + me
        if tl.load(word, volatile=True) == 0:
            release(word, tl.full([], 0, tl.int64) + lcall)


@triton.jit
def ll_finish_send(ctl, hdr, hdr_delta, half, n, sig, R: tl.constexpr, me, USE_ASM: tl.constexpr):
    """End of a low-latency send launch: the last program stores the call's signature and releases
    ``READY[half * R + me] = n`` in every peer's control block (unless this rank holds an error: the
    peers then learn it from ``FAILED``), and records ``n`` as this rank's last sent call."""
    if last_program_at(ctl + L_DONE, USE_ASM):
        _ll_publish(ctl, hdr, hdr_delta, half, n, sig, R, me)


@triton.jit
def ll_finish_send_fused(ctl, hdr, hdr_delta, half, n, sig, R: tl.constexpr, me, USE_ASM: tl.constexpr):
    """:func:`ll_finish_send` at the end of a one-launch call's send part. The last program also releases this
    rank's own ``READY[half * R + me] = n`` when this rank holds an error (only :func:`ll_wait_own` reads that word
    then), so the launch's other programs never wait for a release that would not come."""
    if last_program_at(ctl + L_DONE, USE_ASM):
        _ll_publish(ctl, hdr, hdr_delta, half, n, sig, R, me)
        if tl.load(hdr + W_ERR, volatile=True) != 0:
            release(ctl + off_ll_ready(R) + half * R + me, n)


@triton.jit
def ll_wait_own(ctl, hdr, hdr_delta, host, flag, want, me, stage, lcall, timeout_ns, R: tl.constexpr,
                USE_CLOCK: tl.constexpr):
    """In a one-launch low-latency call, between its parts: wait until ``*flag >= want``, a word of this rank's
    own that the launch's last program to finish the part before releases. Every program of the launch must be
    resident at once (the grid holds no more programs than fit on the multiprocessors, kernels.ll_fused); where they
    are not, the wait runs out and the timeout is recorded against this rank (low-latency call ``lcall``). Returns True when the program may
    move data (this rank holds no error)."""
    ok = tl.load(hdr + W_ERR, volatile=True) == 0
    if ok:
        st = wait_at_least(flag, want, hdr, host, me, 0, timeout_ns, R, USE_CLOCK)
        if st != 0:
            post_error(hdr, hdr_delta, host, st, me, stage, tl.load(hdr + W_BASE) + 1, me, R, ctl, lcall)
            ok = False
    return ok


@triton.jit
def ll_gate(ctl, hdr, hdr_delta, host, me, stage, lcall, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr,
            USE_ASM: tl.constexpr):
    """Every program of a one-launch low-latency call meets here (a grid barrier): each reads ``GATE`` before it
    counts itself at ``DONE2``; the last to count releases ``GATE`` + 1, and all wait for it (:func:`ll_wait_own`:
    bounded, every program resident). What each program stored before is visible to every program after.
    Returns True when the program may move data."""
    g = tl.load(ctl + L_GATE, volatile=True)
    if last_program_at(ctl + L_DONE2, USE_ASM):
        release(ctl + L_GATE, g + 1)
    return ll_wait_own(ctl, hdr, hdr_delta, host, ctl + L_GATE, g + 1, me, stage, lcall, timeout_ns, R, USE_CLOCK)


@triton.jit
def publish_sig(ctl, r, sig, R: tl.constexpr):
    """The ``SIG`` this rank stores in peer ``r`` with its ``READY``: the call's signature, or ``LL_SIG_MASKED``
    where this rank masks ``r`` by hand (``r`` then masks this rank too, by hand, visibly: :func:`ll_wait_peers`;
    a peer masked by a wait learns it from its ``GAVEUP`` word instead)."""
    hand = tl.load(ctl + off_ll_mask(R) + r, volatile=True) == LL_MASK_HAND
    return tl.where(hand, tl.full([], 0, tl.int64) + LL_SIG_MASKED, sig)


@triton.jit
def _ll_publish(ctl, hdr, hdr_delta, half, n, sig, R: tl.constexpr, me):
    if tl.load(hdr + W_ERR, volatile=True) == 0:
        for r in tl.static_range(R):
            peer = ctl + tl.load(hdr_delta + r)
            tl.store(peer + off_ll_sig(R) + half * R + me, publish_sig(ctl, r, sig, R))
            release(peer + off_ll_ready(R) + half * R + me, n)
    tl.store(ctl + L_SEQ, n)


@triton.jit
def ll_defer_send(ctl, n):
    """End of a low-latency send launch without its end-of-launch count (a call without a receive hook, within
    one host: its receive launch follows it in the stream): program (0, 0) records the call as ``NEXT = n``.
    Nothing is published yet: :func:`ll_publish_deferred`, in that receive launch, does it."""
    if flags.first_program():
        tl.store(ctl + L_NEXT, n)


@triton.jit
def ll_publish_deferred(ctl, hdr, hdr_delta, sig, R: tl.constexpr, me):
    """Start of the receive launch of a call whose send launch had no end-of-launch count (:func:`ll_defer_send`):
    returns the call's number ``n = NEXT``, and program (0, 0), before anything waits, does what the send's last
    program would have done (:func:`ll_finish_send`): the signature and ``READY[half * R + me] = n`` in every peer
    (unless this rank holds an error), then ``SEQ = n``. The send launch has completed (stream order), so every
    row it wrote is in place before the release; the peers' receive launches of the call wait for it, and each
    publishes its own in its program (0, 0) before it waits (the programs of a launch start in order, and where
    ranks share a GPU their grids are capped so that no rank's programs keep another's from starting). No
    program of this launch reads ``SEQ``."""
    n = tl.load(ctl + L_NEXT)
    if flags.first_program():
        _ll_publish(ctl, hdr, hdr_delta, n & 1, n, sig, R, me)
    return n


@triton.jit
def ll_finish_recv(ctl, half, n):
    """End of a low-latency receive launch: program (0, 0) records ``PEND[half] = n``. The launch has no
    end-of-launch count: the rank's next low-latency launch, which starts only once this one has completed
    (stream order), releases ``CONS[half] = n`` (:func:`ll_release_cons`; the half is then free for call
    ``n + 2``). A peer waits for that ``CONS`` only in a launch of a later call, and this rank's next low-latency
    launch after this receive (at the latest the first launch of call ``n + 2``; with two hooks outstanding, the
    receive of call ``n + 1``) releases it before it waits for anything, so no wait depends on its own launch."""
    if flags.first_program():
        tl.store(ctl + L_PEND + half, n)


@triton.jit
def ll_release_cons(ctl):
    """First thing of every low-latency launch, in program (0, 0), before any wait: release ``CONS[h] =
    PEND[h]`` for each half whose last receive (a launch before this one in the stream, so complete: its reads
    of the half are done) is not released yet (:func:`ll_finish_recv`)."""
    if flags.first_program():
        for h in tl.static_range(2):
            flags.release_pending(ctl + L_CONS + h, ctl + L_PEND + h)
