"""Issue 3, kinds 8 and 9 in real rank processes on CPU (POSIX shared memory, gloo bootstrap): EP groups
that are subgroups of a larger world, several Buffers alive in one process, a peer that stops answering
in combine. (A peer absent from dispatch and bad input on one rank: test_multiprocess.py; configs for every
R from 1 to 8: test_errors.py, both beside this file.)"""
import pytest

from tests.cases import mp as mp_cases
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


def test_subgroups_of_a_larger_world_and_buffers_side_by_side():
    """World of 6 split into EP groups [1, 2, 3, 4] and [0, 5], both working at once; each member keeps two
    normal Buffers and a low-latency-mode one alive, interleaves calls on the two normal ones, then runs
    back-to-back rounds with fresh routing and no barriers.
    Catches: world ranks used where group ranks are meant (rank 1 of the world writing as rank 1 of the
    group, or the bootstrap over the default group: a hang), shared-memory names or control blocks that
    collide between Buffers or groups, state shared between two Buffers of one process."""
    out = values(run_ranks(mp_cases.subgroups_and_two_buffers, 6, [[1, 2, 3, 4], [0, 5]], 2))
    assert out == [(1, 0), (0, 0), (0, 1), (0, 2), (0, 3), (1, 1)], out


def test_peer_absent_from_combine_times_out_then_recovers():
    """A rank dispatches but never calls combine: the others raise EPTimeoutError (RuntimeError and
    TimeoutError) naming themselves, the missing peer and a combine stage within the bound (2 s, plus
    scheduling slack); then the same processes rebuild a Buffer and run a correct round.
    Catches: a combine that waits unbounded (hang), an error naming the wrong peer or stage, a process
    left unusable (leaked shared state) after the timeout."""
    out = values(run_ranks(mp_cases.absent_in_combine, 3, 2.0))
    for rank in (0, 1):
        is_rt, is_to, r, peer, stage, waited, msg = out[rank]
        assert is_rt and is_to and (r, peer) == (rank, 2), out[rank]
        assert stage.startswith("combine"), stage
        assert 2.0 <= waited < 20, waited
        assert f"rank {rank}" in msg and "peer 2" in msg and stage in msg
    assert out[2] is None
