"""Faults of the RDMA proxy across 2 emulated hosts of 2 ranks, low-latency mode (rank bodies:
tests/cases/proxy_faults.py): every rank names the root cause, never a live rank that merely destroyed its Buffer.
Nothing is left (the autouse fixture: /dev/shm, processes)."""
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
