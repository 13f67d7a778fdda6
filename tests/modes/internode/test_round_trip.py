"""Internode normal mode across processes (one machine standing in for several hosts, the emulated RDMA
fabric): dispatch bit-exact against the reference, combine bit-exact against the reference's two-level
summation order, cached dispatch, num_worst_tokens, FP8 pairs, biases."""
import pytest

import internode_cases as cases
from triton_ep.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess


def _values(out):
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(str(o) for o in bad)
    return out


def _env(per_host):
    return {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated"}


@pytest.mark.parametrize("world,per_host,Ts,kw", [
    (2, 1, [9, 0], {}),                                   # 2 hosts of 1 rank, an empty rank
    (4, 2, [7, 13, 1, 5], {"bias": True}),                # 2 hosts of 2 ranks
    (3, 1, [6, 3, 8], {"worst": 40, "weights": False}),   # 3 hosts of 1 rank, num_worst_tokens, no weights
])
def test_round_trip(world, per_host, Ts, kw):
    out = _values(run_ranks(cases.round_trip, world, _env(per_host), 5 + world, 4 * world, 3, 64, Ts, kw,
                            timeout_s=240))
    assert all(o["combined"] for o in out), out
    assert sum(o["rows"] for o in out) > 0


def test_fp8_pairs_across_hosts():
    out = _values(run_ranks(cases.round_trip, 2, _env(1), 3, 8, 2, 256, [5, 4], {"fp8": True}, timeout_s=240))
    assert all(o["rows"] >= 0 for o in out)
