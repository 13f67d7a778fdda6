"""Low-latency calls as one launch each (triton_ep.kernels.ll_fused), on CPU: real rank processes, kernels under
the interpreter, ``TRITON_EP_FUSED=1`` set in the rank processes (one program a launch here; on a GPU the calls
take this path by default). Every result is checked against the oracle in tests/cases/ll.py, as the split
launches' are in test_low_latency.py."""
import pytest
from hypothesis import given, settings, strategies as st

from tests.cases import ll as ll_cases
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.multiprocess

FUSED = {"TRITON_EP_FUSED": "1"}


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


def test_one_launch_per_call_and_one_send_launch_with_a_hook():
    """A dispatch or a combine without a hook is one launch; with a hook, a dispatch's route and send are one
    launch and its hook one more (the receive); a combine's send and its hook one each. Results equal the
    oracle's; the launch counters are back at 0 and the gate passed once per dispatch."""
    for steps, (done, done2, gate) in _values(run_ranks(ll_cases.launches_per_call, 2)):
        assert steps == {
            "dispatch fp8=False": ["ll_dispatch_fused"],
            "dispatch fp8=True": ["ll_dispatch_fused"],
            "dispatch with hook": ["ll_dispatch_fused"],
            "dispatch hook": ["ll_dispatch_recv"],
            "combine": ["ll_combine_fused"],
            "combine with hook": ["ll_combine_send"],
            "combine hook": ["ll_combine_reduce"],
        }, steps
        assert (done, done2, gate) == (0, 0, 4), (done, done2, gate)


_case = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.sampled_from(["identity", "affine"]),
                  st.booleans(), st.booleans())


@pytest.mark.property
@settings(max_examples=1, deadline=None)
@given(R=st.sampled_from([2, 3]), seed=st.integers(0, 1000), K=st.sampled_from([1, 3, 4]),
       cases=st.lists(_case, min_size=2, max_size=4), zero_rank=st.booleans())
def test_round_trip_property_in_one_launch(R, seed, K, cases, zero_rank):
    """As test_low_latency's property (ragged T with an empty rank, -1 ids, duplicates, skew; bf16 / FP8 /
    round_scale / UE8M0, hooks, zero-copy, stats), every call in one launch."""
    N, E, H = 8, 2 * R, 512
    cases = [(f, rs and f, u and f and rs, kind, hook, zc) for f, rs, u, kind, hook, zc in cases]
    Ts = [0 if (zero_rank and r == R - 1) else 1 + (seed + 3 * r) % N for r in range(R)]
    _values(run_ranks(ll_cases.across_hosts, R, FUSED, "round_trip", seed, E, K, H, Ts, N, cases))


def test_two_outstanding_hooks_in_one_launch():
    out = _values(run_ranks(ll_cases.across_hosts, 2, FUSED, "two_live_hooks", 11, 4, 2, 128, [6, 5], 8))
    assert out == [True, True]


def test_masked_rank_in_one_launch():
    """A silent rank masked by hand: exactly its tokens are dropped. (Masking by enable_shrink's timeout happens in
    the same wait, ll_wait_peers, in both launch forms: test_low_latency.py times it.)"""
    out = _values(run_ranks(ll_cases.across_hosts, 3, FUSED, "masked_rank", 5, 6, 2, 128, [5, 6, 4], 8, 2, False))
    assert out[2] is None
    for status, after, _ in out[:2]:
        assert status == [0, 0, 1] and after == [0, 0, 0], (status, after)


def test_bad_ids_then_recover_in_one_launch():
    """Bad ids found by the one launch's route part: ValueError on the rank that passed them, EPRemoteError on
    its peer, and the next call is correct."""
    out = _values(run_ranks(ll_cases.across_hosts, 2, FUSED, "bad_ids_then_recover", 8, 128, 4))
    assert all(o[:2] == ["N: ValueError", "N: ValueError"] for o in out), out    # a str N (as every size), N = 0
    assert out[1][2:4] == ["shape", "ValueError (2 ids)"], out
    assert out[0][2] == "shape" and "EPRemoteError" in out[0][3:], out
    # a float32 out, a bf16 of T+1, a non-contiguous bf16 [T, H]; then two non-contiguous stats tensors
    assert all(o[-5:-2] == ["out: TypeError", "out: ValueError", "out: ValueError (non-contiguous)"] for o in out), out
    assert all(len(o[-2:]) == 2 and all("got a non-contiguous tensor of shape" in e for e in o[-2:]) for o in out), out


def test_decode_steps_replay_the_last_calls_plan():
    """Low-latency calls of the last call's sizes replay its plan (modes/low_latency/replay.py): fresh inputs each
    step, every result against the oracle; another stats argument, a hook, a non-contiguous x and the
    re-synchronisation after a rank's bad ids take the general path; the replayed call with bad ids raises
    ``ValueError`` on that rank and ``EPRemoteError`` on its peer; ``destroy()`` drops the plans."""
    out = _values(run_ranks(ll_cases.replayed_calls, 2))
    for rank, (d, c, err) in enumerate(out):
        assert (d, c) == (6, 9), (rank, d, c)
        assert err == ("ValueError" if rank == 1 else "EPRemoteError"), (rank, err)
