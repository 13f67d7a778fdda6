"""Low-latency mode across hosts on CPU: rank processes standing in for hosts (``TRITON_EP_RANKS_PER_HOST``)
over the emulated RDMA fabric, kernels under the interpreter; every result checked against the oracle of
tests/ll_cases.py, bit for bit as within one host."""
import pytest

import ll_cases
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


def _env(per_host):
    return {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated"}


# (use_fp8, round_scale, use_ue8m0, expert, hook, zero_copy)
_CASES = [(False, False, False, "identity", False, False), (True, False, False, "affine", True, False),
          (True, True, True, "affine", False, True), (False, False, False, "affine", True, True),
          (True, True, False, "identity", False, False)]


@pytest.mark.parametrize("world,per_host,allow_nvlink", [(2, 1, True), (4, 2, False), (4, 2, True)])
def test_round_trip_across_hosts(world, per_host, allow_nvlink):
    """2 hosts of 1 and of 2 ranks, ``allow_nvlink_for_low_latency_mode`` both ways: bf16, FP8, round_scale,
    UE8M0, hooks and zero-copy, ragged T up to N with an empty rank, -1 ids, duplicates and skew; N = 8."""
    N, H, K = 8, 512, 3
    E = 2 * world
    Ts = [N, 3, 0, 5][:world] if world > 2 else [N, 0]
    out = _values(run_ranks(ll_cases.across_hosts, world, _env(per_host), "round_trip", 5, E, K, H, Ts, N, _CASES,
                            allow_nvlink))
    assert sum(out) > 0, out


def test_skew_to_one_remote_expert():
    """Every token of every rank to one expert on another host (duplicates within tokens, -1 entries)."""
    _values(run_ranks(ll_cases.across_hosts, 2, _env(1), "skew_to_remote", 4, 4, 128, 8, 8))


def test_two_outstanding_hooks_received_in_reverse_order():
    out = _values(run_ranks(ll_cases.across_hosts, 2, _env(1), "two_live_hooks", 11, 4, 2, 128, [6, 5], 8, False))
    assert out == [False, False]


def test_rejected_call_raises_everywhere_at_once_then_the_buffer_says_so():
    """Rank 0 rejects its arguments: TypeError there, EPRemoteError naming it on the other host well within
    the timeout (the failure travels in the call's chunk); later low-latency calls raise EPError."""
    out = _values(run_ranks(ll_cases.across_hosts, 2, _env(1), "rejected_across_hosts", 8, 128, 4))
    assert out[0]["first"][0] == "TypeError", out
    assert out[1]["first"][0] == "EPRemoteError" and "rank 0" in out[1]["first"][1], out
    assert all(o["seconds"] < 15 for o in out), out
    assert all(o["after"][0] == "EPError" and "destroy" in o["after"][1] for o in out), out
