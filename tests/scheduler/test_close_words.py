"""Close words (triton_ep/scheduler/: ``close_word``, ``Scheduler.tell_closing``): a rank whose scheduler closes
(its Buffer destroyed) is alive, not gone. Its peers name it as closed (``PeerClosedError``), not gone
(``PeerGoneError``), once their probes find its QPs gone; where it closed after an error it heard of, they name that
error's rank (the root cause) at once. Ranks as emulated hosts in this process, the proxy as a thread of it and as
a process of its own (``ProcGroup``)."""
from __future__ import annotations

import time

import pytest

from triton_ep.errors import EPRemoteError
from triton_ep.scheduler import (PeerClosedError, PeerGoneError, ProxyError, ProxyRemoteError, RootCauseError,
                                 close_word, fault_gone, fault_word, mode_root, parse_close, parse_fault, placed_error,
                                 root_cause)
from triton_ep.scheduler.faults import ROOT_CLOSED, ROOT_FAILED, ROOT_GONE, close_root, fails_at_once

from tests.cases.sched_helpers import Group, ProcGroup, fabric, in_threads
from tests.scheduler.test_scheduler import alltoall_checked

GROUPS = {"thread": Group, "process": ProcGroup}


def _close_rank(g, r: int) -> None:
    """Close rank ``r``'s scheduler (and transport) and take it out of ``g``."""
    g.scheds.pop(r).close()
    if g.ts:
        g.ts.pop(r).close()


def _error_within(sched, bound_s: float):
    """The scheduler's error (``check()`` raises it) within ``bound_s`` seconds, and the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        try:
            sched.check()
        except Exception as ex:     # noqa: BLE001 - returned
            return ex, time.monotonic() - t0
        time.sleep(0.01)
    return None, bound_s


def test_close_word_round_trip():
    """A clean close names no rank; a close after an error names its rank and how it left (failed, gone, or closed
    first: only the first two fail the reader at once); the rank a closing proxy's error makes its root."""
    assert parse_close(close_word(3)) == (None, None)
    for how in (ROOT_FAILED, ROOT_GONE, ROOT_CLOSED):
        assert parse_close(close_word(3, 5, how)) == (5, how)
        assert fails_at_once(close_word(3, 5, how)) == (how != ROOT_CLOSED)
    assert parse_close(close_word(3, None, None)) == (None, None) and not fails_at_once(close_word(3))
    assert fails_at_once(fault_word(3, 0, 1))
    with pytest.raises(ValueError, match="how must be one of"):
        close_word(3, 5, "left")
    why = "planted"
    assert close_root(None, 1) == (None, None)
    assert close_root(PeerClosedError(1, 2, None, None, "s", why), 1) == (2, ROOT_CLOSED)
    assert close_root(PeerGoneError(1, 2, None, None, "s", why), 1) == (2, ROOT_GONE)
    assert close_root(ProxyRemoteError(1, 2, None, None, "s", why), 1) == (2, ROOT_FAILED)
    assert close_root(ProxyError(1, 2, None, None, "s", why), 1) == (1, ROOT_FAILED)
    assert close_root(RuntimeError(why), 1) == (1, ROOT_FAILED)


def test_fault_word_with_a_root_of_the_modes_numbering_round_trip():
    """A fault word may name a root of the mode's numbering (a rank the scheduler has no number for, gone or failed:
    ``MODE_ROOT``, issue 46): it reads back as that root and as no gone rank of the scheduler's, with its stage, and
    fails its reader at once; a word names a gone peer or such a root, not both, and the root is gone or failed. A
    ``RootCauseError`` is placed once at the stage its rank waited at, as a ``PeerGoneError`` is."""
    for how in (ROOT_GONE, ROOT_FAILED):
        w = fault_word(3, None, None, root=(9000, how))
        assert mode_root(w) == (9000, how) and fault_gone(w) is None and parse_fault(w) == (3, None, None)
        assert fails_at_once(w) and parse_close(w) == (None, None)
    assert mode_root(fault_word(3, 0, 1, 5)) is None and fault_gone(fault_word(3, 0, 1, 5)) == 5
    for gone, root in ((5, (1, ROOT_GONE)), (None, (1, ROOT_CLOSED)), (None, (0x3FFF, ROOT_GONE))):
        with pytest.raises(ValueError, match="a fault word names a gone peer or a root"):
            fault_word(3, None, None, gone, root)
    ex = RootCauseError(1, 0, None, None, "rdma proxy", "planted", 7, ROOT_GONE)
    placed = placed_error(ex, "rdma host exchange")
    assert (placed.stage, placed.placed, placed.root, placed.how, placed.peer) == \
        ("rdma host exchange", True, 7, ROOT_GONE, 0), repr(placed)
    assert placed_error(placed, "later") is placed


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_fault_word_names_a_root_the_scheduler_does_not_number(kind):
    """2 ranks; rank 0's scheduler fails with an error marked with rank 7 of the mode's numbering, gone
    (``root_cause``: in internode normal mode a host mate, which the network leg, one rank per host, does not
    number): rank 1 raises RootCauseError within 2 s, naming rank 0 as the peer that told it and rank 7 (gone) as the
    root (before: ProxyRemoteError naming rank 0 alone). With a proxy process the mark crosses its channel."""
    with GROUPS[kind](fabric(2), 2, qps=2, slots=2, slot_bytes=1024, timeout_s=20.0) as g:
        alltoall_checked(g, {(0, 1): 1000, (1, 0): 1500})
        g.scheds[0].fail(root_cause(EPRemoteError("planted: rank 0's host leg failed"), 7, ROOT_GONE))
        ex, dt = _error_within(g.scheds[1], 10.0)
    assert type(ex) is RootCauseError and (ex.peer, ex.root, ex.how) == (0, 7, ROOT_GONE), repr(ex)
    assert dt < 2.0, (dt, str(ex))


def test_a_peer_that_closes_is_named_closed_not_gone():
    """2 ranks; after an all-to-all rank 1 closes its scheduler (destroy()): rank 0's proxy, whose probes then find
    rank 1's QPs gone, raises PeerClosedError naming rank 1 within seconds (before: PeerGoneError, "rank 1's process
    is gone"), not at once (what rank 1 sent was placed: nothing failed until its QPs went). Proxy processes only:
    the emulated fabric sees a peer's QPs gone once the process that held them released its rings' locks (the thread
    kind: tests/modes/internode/test_proxy_faults.py, ranks as processes)."""
    with ProcGroup(fabric(2), 2, qps=2, slots=2, slot_bytes=1024, timeout_s=20.0) as g:
        alltoall_checked(g, {(0, 1): 3000, (1, 0): 5000})
        _close_rank(g, 1)
        ex, dt = _error_within(g.scheds[0], 10.0)
    assert isinstance(ex, PeerClosedError) and not isinstance(ex, PeerGoneError), repr(ex)
    assert ex.peer == 1 and "destroyed its Buffer" in str(ex), str(ex)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_peer_that_closes_after_an_error_names_the_root_cause(kind):
    """3 ranks; rank 1's proxy fails because rank 2's failed (a ProxyRemoteError naming it: such a failure writes no
    fault word) and rank 1 closes: rank 0 raises ProxyRemoteError naming rank 2 (the root cause) within 2 s (before:
    PeerGoneError naming rank 1, the live rank that closed, once its probes found rank 1's QPs gone)."""
    with GROUPS[kind](fabric(3), 3, qps=2, slots=2, slot_bytes=1024, timeout_s=20.0) as g:
        alltoall_checked(g, {(a, b): 1000 + 10 * a + b for a in range(3) for b in range(3) if a != b})
        g.scheds[1].fail(ProxyRemoteError(1, 2, None, None, "rdma proxy", "planted: rank 2's proxy failed"))
        _close_rank(g, 1)
        ex, dt = _error_within(g.scheds[0], 10.0)
    assert type(ex) is ProxyRemoteError and ex.peer == 2, repr(ex)
    assert "destroyed its Buffer and told this rank" in str(ex) and dt < 2.0, (dt, str(ex))


def test_a_close_after_a_peers_clean_close_names_that_peer():
    """3 ranks, QPs as low-latency mode across hosts lays them out: rank 0 reaches ranks 1 and 2, ranks 1 and 2 only
    rank 0 (rank 1 has none to rank 2). Rank 2 closes cleanly; rank 0's probes find its QPs gone (PeerClosedError
    naming rank 2) and rank 0 closes after that error; rank 1, which can learn of rank 2 only from rank 0, raises
    PeerClosedError naming rank 2, the rank that left first (before: rank 0, whose close after rank 2's was written
    as a clean close of its own). Proxy processes only (as the clean close's test)."""
    peers = {0: [1, 2], 1: [0], 2: [0]}
    with ProcGroup(fabric(3), 3, qps=2, slots=2, slot_bytes=1024, timeout_s=20.0, peers=peers) as g:
        _close_rank(g, 2)
        ex0, _ = _error_within(g.scheds[0], 10.0)
        _close_rank(g, 0)
        ex1, _ = _error_within(g.scheds[0], 10.0)      # (rank 1's: the only one left)
    assert isinstance(ex0, PeerClosedError) and ex0.peer == 2, repr(ex0)
    assert isinstance(ex1, PeerClosedError) and not isinstance(ex1, PeerGoneError), repr(ex1)
    assert ex1.peer == 2 and "destroyed its Buffer" in str(ex1), str(ex1)
