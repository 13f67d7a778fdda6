"""TRITON_EP_PROXY across emulated hosts (triton_ep/proxy_process.py): the ranks agree on it in the network leg's
set-up exchange, and a Buffer whose proxy process is killed raises ProxyError at that rank within 2 s; nothing
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


def test_a_killed_proxy_process_is_a_proxy_error_at_its_rank():
    out = run_ranks(proxy_cases.proxy_killed, 2, dict(ENV, TRITON_EP_PROXY="process"), 30.0, timeout_s=180)
    assert not any(isinstance(o, RankFailure) for o in out), out
    dt, kind, msg, kind2, msg2, reaped = out[1]
    assert dt < 2.0 and kind == "ProxyError", out[1]
    assert "rank 1" in msg and "proxy process" in msg and "killed by signal 9" in msg, msg
    assert kind2 in ("ProxyError", "EPRemoteError"), out[1]
    assert reaped and out[0] == [True], out
