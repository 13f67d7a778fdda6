"""TRITON_EP_PROXY across emulated hosts (triton_ep/proxy_process/): every rank of the Buffer's group agrees on
it in the mode's set-up exchange, and a Buffer whose proxy process is killed raises ProxyError at that rank within 2 s; nothing
is left (the autouse fixture: /dev/shm, processes)."""
import pytest

from tests.cases import internode as internode_cases
from tests.cases import proxy as proxy_cases
from triton_ep.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess

ENV = {"TRITON_EP_RANKS_PER_HOST": "1", "TRITON_EP_RDMA": "emulated"}


@pytest.mark.parametrize("values,want", [
    (["thread", "process"], "ranks disagree on TRITON_EP_PROXY (where the RDMA proxy runs) (rank 0: 'thread', "
                            "rank 1: 'process')"),
    (["process", "fork"], "rank 1: TRITON_EP_PROXY='fork'"),
])
def test_ranks_agree_on_where_the_proxy_runs(values, want):
    out = run_ranks(internode_cases.build_only, 2, [dict(ENV, TRITON_EP_PROXY=v) for v in values], {},
                    timeout_s=120)
    assert all(o is not None and not isinstance(o, RankFailure) for o in out), out
    for kind, msg in out:
        assert kind == "ValueError" and want in msg, (kind, msg)


@pytest.mark.parametrize("kwargs", [{}, dict(low_latency_mode=True, num_rdma_bytes=1 << 20, num_qps_per_rank=2)],
                         ids=["normal", "low_latency"])
def test_every_rank_of_the_group_agrees_on_where_the_proxy_runs(kwargs):
    """2 hosts of 2 ranks, only rank 3 sets thread: every rank raises ValueError naming rank 3's value by its rank
    in the group at set-up (before: only ranks 1 and 3, which share a network leg, raised, naming leg-local
    ranks; ranks 0 and 2 built their Buffer and waited out timeout_s in their first call)."""
    env = [dict(ENV, TRITON_EP_RANKS_PER_HOST="2", TRITON_EP_PROXY="thread" if r == 3 else "process")
           for r in range(4)]
    out = run_ranks(internode_cases.build_only, 4, env, kwargs, timeout_s=120)
    assert all(o is not None and not isinstance(o, RankFailure) for o in out), out
    for kind, msg in out:
        assert kind == "ValueError" and "TRITON_EP_PROXY" in msg and "rank 3: 'thread'" in msg, (kind, msg)


def test_a_killed_proxy_process_is_a_proxy_error_at_its_rank_and_its_peer():
    """Rank 1's proxy process SIGKILLed: rank 1 raises ProxyError within 2 s; rank 0 (timeout 30 s) hears of it from
    rank 1's process through the group's store and raises ProxyRemoteError naming rank 1 within 5 s (before: it
    waited out its bound, a dead proxy writes no fault word); both next dispatches raise; destroy reaps both."""
    out = run_ranks(proxy_cases.proxy_killed, 2, dict(ENV, TRITON_EP_PROXY="process"), 30.0, timeout_s=180)
    assert not any(isinstance(o, RankFailure) for o in out), out
    dt, kind, msg, kind2, msg2, reaped = out[1]
    assert dt < 2.0 and kind == "ProxyError", out[1]
    assert "rank 1" in msg and "proxy process" in msg and "killed by signal 9" in msg, msg
    assert kind2 in ("ProxyError", "EPRemoteError"), out[1]
    assert reaped, out
    dt, kind, msg, kind2, msg2, reaped = out[0]
    assert dt is not None and dt < 5.0 and kind == "ProxyRemoteError", out[0]
    assert "peer 1" in msg and "the peer's RDMA proxy process ended (pid " in msg and "killed by signal 9" in msg, msg
    assert kind2 in ("ProxyRemoteError", "ProxyError", "EPRemoteError"), out[0]
    assert reaped, out


def test_a_rank_whose_proxy_cannot_start_fails_every_rank_at_once():
    """Rank 1's /dev/shm has no room for its proxy process's rings: rank 1 raises the OSError that names the size,
    the container options and TRITON_EP_PROXY=thread; rank 0 (timeout 60 s) raises EPRemoteError quoting it within
    10 s, not at its bound (before: it waited in the QP-info exchange for timeout_s). Nothing is left (the fixture
    checks /dev/shm and processes)."""
    out = run_ranks(proxy_cases.proxy_without_room, 2, dict(ENV, TRITON_EP_PROXY="process"), 60.0, timeout_s=180)
    assert not any(isinstance(o, RankFailure) for o in out), out
    dt, kind, msg = out[1]
    assert kind == "OSError" and "--shm-size" in msg and "TRITON_EP_PROXY=thread" in msg, out[1]
    dt, kind, msg = out[0]
    assert kind == "EPRemoteError" and dt < 10.0, out[0]
    assert "rank 1" in msg and "could not start its RDMA proxy process" in msg and "--shm-size" in msg, msg


def test_a_forked_child_that_destroys_the_buffer_changes_nothing():
    """A process forked from rank 0 calls destroy() on the Buffer it inherited and exits 0 (before: a segmentation
    fault in the child, with either proxy kind); its calls before that raise EPError naming the fork (before: they
    paired with rank 1's calls in rank 0's place); rank 0's Buffer still moves tokens exactly afterwards."""
    out = run_ranks(proxy_cases.forked_child_destroys, 2, ENV, 60.0, timeout_s=180)
    assert not any(isinstance(o, RankFailure) for o in out), out
    assert out[0] == [0, True] and out[1] == [None, True], out
