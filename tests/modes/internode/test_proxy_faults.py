"""Faults of the RDMA proxy across 2 emulated hosts of 2 ranks, low-latency mode (a stopped proxy in normal mode too;
rank bodies: tests/cases/proxy_faults.py): every rank names the root cause, never a live rank that merely destroyed its
Buffer. Nothing is left (the autouse fixture: /dev/shm, processes)."""
import os

import pytest

from tests.cases import proxy_faults as cases
from triton_ep.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess


def _ok(out) -> None:
    assert not any(o is None or isinstance(o, RankFailure) for o in out), out


def test_a_killed_proxy_process_is_named_on_every_rank(proxy_mode):
    """Rank 2's proxy process SIGKILLed after a warm-up low-latency dispatch; every rank dispatches twice and destroys
    its Buffer. Rank 2 raises its ProxyError; ranks 0, 1 (its RDMA peers) and 3 (its host mate, which has no QP to it)
    raise a ProxyRemoteError naming rank 2, never a PeerGoneError naming rank 0 or 1 (before: rank 3 did, after
    about 1.5-3 s, once those live ranks had destroyed their Buffers after their own errors: their QPs went, and their
    close did not say why). Proxy processes only."""
    if proxy_mode != "process":
        pytest.skip("a proxy process is killed")
    out = run_ranks(cases.ll_proxy_killed, 4, 2, 20.0, timeout_s=240)
    _ok(out)
    for r, (calls, destroy_s) in enumerate(out):
        kind, msg, dt = calls[0]
        if r == 2:
            assert kind == "ProxyError" and "rank 2" in msg and "killed by signal 9" in msg, (r, calls[0])
        else:
            assert kind == "ProxyRemoteError" and f"rank {r} failed" in msg and "(peer 2)" in msg, (r, calls[0])
        assert dt < 10.0 and calls[1][0] != "no error" and destroy_s < 10.0, (r, calls, destroy_s)


@pytest.mark.extended   # (11-39 s on 2 cores; tests/scheduler/test_close_words.py holds the same rule in 2 s)
def test_a_buffer_destroyed_first_is_named_on_every_rank(proxy_mode):
    """Rank 2 destroys its Buffer (a clean close; its process lives on) after a warm-up low-latency dispatch; every
    other rank dispatches twice and destroys its Buffer at once. Every one of them raises PeerClosedError naming rank
    2, the rank that left first: ranks 0 and 1 (its RDMA peers) find its QPs gone, rank 3 (its host mate, which has
    no QP to it) hears of it in the close word of rank 0 or 1, which closed because of it (before: rank 3 named rank
    0, whose close after rank 2's was written as a clean close of its own: 1.5 s into its call, both proxy kinds).
    Each call raises within timeout_s / 2 and each destroy() returns within 5 s."""
    timeout_s = 20.0
    out = run_ranks(cases.ll_destroyed_early, 4, 2, timeout_s, timeout_s=240)
    _ok(out)
    assert out[2][0] == [] and out[2][1] < 5.0, out[2]
    for r in (0, 1, 3):
        calls, destroy_s = out[r]
        for kind, msg, dt in calls:
            assert kind == "PeerClosedError" and f"rank {r} failed" in msg and "(peer 2" in msg \
                and "destroyed its Buffer" in msg and dt < timeout_s / 2, (r, calls)
        assert destroy_s < 5.0, (r, destroy_s)


def test_destroy_is_bounded_when_the_store_host_died_with_a_forked_child(proxy_mode, tmp_path):
    """2 hosts of 2 ranks, the group over a TCPStore hosted by rank 0; rank 0 forks a child that lives on, then dies.
    The child holds the store server's sockets, so the survivors' store requests are taken and never answered (a
    ``check`` blocked > 190 s whatever the store's timeout). Each survivor's normal-mode dispatch raises within
    timeout_s (20 s) and its destroy() returns within 10 s (before: the dispatch took 60 s, blocked telling its RDMA
    peer it took the host path, and destroy() 58 s, blocked meeting the RDMA peers, deleting keys and joining the
    fault-notice threads: every store call of theirs is now bounded)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_ranks(cases.died_with_child, 4, "internode", 20.0, str(tmp_path / "done"), port, 10.0, timeout_s=240)
    assert isinstance(out[0], RankFailure) and "-9" in str(out[0]), out[0]
    _ok(out[1:])
    for r, (calls, destroy_s) in enumerate(out[1:], 1):
        kind, msg, dt = calls[0]
        # (with proxy threads rank 0's RDMA peer times out naming peer 0: the child holds rank 0's NIC context, so its
        # QPs still acknowledge the probes; a proxy process ends with its rank, its QPs with it)
        assert kind != "no error" and ("rank 0" in msg or "peer 0" in msg) and dt < 20.0 + 5.0, (r, calls)
        assert destroy_s < 10.0, (r, destroy_s)


@pytest.mark.parametrize("mode", ["internode_ll", "internode"])
def test_a_stopped_proxy_process_is_named_by_its_own_rank(mode, proxy_mode):
    """Rank 2's proxy process stopped (SIGSTOP, by its rank) after a warm-up call of ``mode``; every rank makes the
    call twice and destroys its Buffer (timeout_s 20 s). Rank 2 raises a ProxyError naming its own proxy process (its
    pid, "stopped by a signal": its heartbeat stood still for 1 s, its state T) within timeout_s / 2 (1.1-1.5 s on 2
    cores at a load of 11-18, the other ranks 1.2-1.9 s; above 5 s at a load of 30), where before it waited out
    timeout_s and blamed a peer ("waited 20 s for peer 0 ... the peer stopped answering"). In low-latency mode every
    other rank raises a ProxyRemoteError naming rank 2 (told through the group's store; rank 3, its host mate, whose
    call may need nothing of rank 2's proxy, at its first or second call); in normal mode rank 2's RDMA peer (rank 0)
    does, and ranks 1 and 3 raise a remote error of the ranks that failed before them (the host mate that left the
    group, or its RDMA peer's fault word: as with a killed proxy), never a timeout. destroy() kills the stopped proxy
    at once; no process is left (its pid gone too), nor anything in /dev/shm (the autouse fixture). Proxy processes
    only."""
    if proxy_mode != "process":
        pytest.skip("a proxy process is stopped")
    timeout_s = 20.0
    out = run_ranks(cases.proxy_stopped, 4, mode, 2, timeout_s, timeout_s=240)
    _ok(out)
    pid = out[2][2]
    for r, (calls, destroy_s, _) in enumerate(out):
        first = 1 if mode == "internode_ll" and r == 3 and calls[0][0] == "no error" else 0
        kind, msg, dt = calls[first]
        if r == 2:
            assert kind == "ProxyError" and "rank 2 failed" in msg and f"proxy process (pid {pid}) stopped making " \
                   "progress: stopped by a signal such as SIGSTOP (state T)" in msg, (r, calls)
        elif mode == "internode_ll" or r == 0:
            assert kind == "ProxyRemoteError" and f"rank {r} failed" in msg and "(peer 2)" in msg \
                and "stopped making progress" in msg, (r, calls)
        else:
            assert kind in ("EPRemoteError", "ProxyRemoteError"), (r, calls)
        assert all(c[2] < timeout_s / 2 for c in calls) and calls[1][0] != "no error", (r, [c[::2] for c in calls])
        assert destroy_s < 5.0, (r, destroy_s)
    assert not os.path.exists(f"/proc/{pid}"), pid


def test_ranks_waiting_to_re_synchronise_hear_a_stopped_proxy_at_once(proxy_mode):
    """(A fresh-clone CI run on 2 cores, test_a_stopped_proxy_process_is_named_by_its_own_rank: rank 3 learnt of rank
    2's failure from its failure word before rank 2's notice that its proxy process stopped came through the group's
    store, raised EPRemoteError, and at its next call waited out timeout_s, 20 s, for rank 2 at 'low-latency across
    hosts: re-synchronise after an error': rank 2, its proxy failed, never comes, and the meeting did not look at the
    proxy's error.) Ranks 0, 1 and 3 refuse a dispatch (float32 x) and wait at that meeting with their next; rank 2's
    proxy process stops 1 s later and rank 2 never comes: each of them raises ProxyRemoteError naming rank 2 once its
    rank's notice comes (before: EPTimeoutError after timeout_s); rank 2 raises its ProxyError. Proxy processes
    only."""
    if proxy_mode != "process":
        pytest.skip("a proxy process is stopped")
    timeout_s = 20.0
    out = run_ranks(cases.ll_proxy_stopped_while_meeting, 4, 2, timeout_s, timeout_s=240)
    _ok(out)
    for r, (calls, destroy_s) in enumerate(out):
        if r == 2:
            kind, msg, _ = calls[0]
            assert kind == "ProxyError" and "stopped making progress" in msg, (r, calls)
        else:
            assert calls[0][0] == "TypeError" and "x" in calls[0][1], (r, calls)
            kind, msg, dt = calls[1]
            assert kind == "ProxyRemoteError" and f"rank {r} failed" in msg and "(peer 2)" in msg \
                and "stopped making progress" in msg and dt < timeout_s / 2, (r, calls)
        assert calls[1][0] != "no error" and destroy_s < 5.0, (r, calls, destroy_s)


@pytest.mark.extended   # (the rule of test_a_stopped_proxy_process_is_named_by_its_own_rank, the race more often)
def test_a_host_mate_named_by_its_failure_word_first_names_its_stopped_proxy(proxy_mode):
    """Rank 2's proxy process stopped; rank 3 (its host mate) looks at the peers' fault notices only every 5 s (its
    thread's, at a phase the test does not set: a weak forcing). Where rank 2's failure word ends rank 3's first call
    (before the fix: 1 run of 4 on a 2-core machine at a load of about 8, none of 6 at a load of about 5), rank 3
    still raises ProxyRemoteError naming rank 2's proxy: rank 2 posted its notice before its ring waits ended, and
    rank 3 looks at the notices when a failure word ends its wait (before: EPRemoteError "rank 2 failed the call", then
    a 20 s timeout at the re-synchronisation, as in the CI run above). Every rank raises within timeout_s / 2. Proxy
    processes only."""
    if proxy_mode != "process":
        pytest.skip("a proxy process is stopped")
    timeout_s = 20.0
    out = run_ranks(cases.proxy_stopped, 4, "internode_ll", 2, timeout_s, 5.0, timeout_s=240)
    _ok(out)
    for r, (calls, destroy_s, _) in enumerate(out):
        errors = [c for c in calls if c[0] != "no error"]
        assert errors and all(c[2] < timeout_s / 2 for c in calls), (r, calls)
        kind, msg, _ = errors[0]
        if r == 2:
            assert kind == "ProxyError" and "stopped making progress" in msg, (r, calls)
        else:
            assert kind == "ProxyRemoteError" and f"rank {r} failed" in msg and "(peer 2)" in msg \
                and "stopped making progress" in msg, (r, calls)
        assert destroy_s < 5.0, (r, destroy_s)
