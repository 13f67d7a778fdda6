"""GPU tests of low-latency mode (marker ``gpu``): two processes on one GPU bootstrapped over gloo, CUDA
graph capture and replay with fresh routing, and the receive hook with compute between send and receive."""
import pytest

from tests.cases import ll as ll_cases
from tests.cases.helpers import ok_results
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("use_fp8", [False, True])
def test_graph_capture_and_100_replays_bit_exact(use_fp8):
    out = ok_results(run_ranks(ll_cases.gpu_graph_replay, 2, use_fp8, 100, 16, 4, 256, 24, 32, backend="gloo"))
    assert out == [100, 100], out


@pytest.mark.parametrize("use_fp8", [False, True])
def test_graph_of_one_launch_calls_bit_exact(use_fp8):
    """``TRITON_EP_FUSED=1``: the captured calls are one launch each too (a capture takes the split launches
    unless forced), replayed with fresh routing, every replay equal to the oracle."""
    out = ok_results(run_ranks(ll_cases.across_hosts, 2, {"TRITON_EP_FUSED": "1"}, "gpu_graph_replay", use_fp8, 30,
                               16, 4, 256, 24, 32, backend="gloo"))
    assert out == [30, 30], out


@pytest.mark.parametrize("fused", ["default", "0"])
def test_hook_with_compute_between_send_and_receive(fused):
    """The hook path, its send as one launch (route and send; the default on a GPU) and split (``0``)."""
    env = {} if fused == "default" else {"TRITON_EP_FUSED": fused}
    out = ok_results(run_ranks(ll_cases.across_hosts, 2, env, "gpu_hook_overlap", 16, 4, 512, 40, 64, backend="gloo"))
    assert out == [True, True], out


def test_a_call_of_other_sizes_waits_for_a_slow_peer():
    """The fence launch before a call of new sizes on the GPU: rank 1 holds its combine's hook while rank 0
    dispatches with smaller N into rank 1's experts; every result equals the oracle."""
    out = ok_results(run_ranks(ll_cases.size_change, 2, 1.5, "cuda", backend="gloo"))
    assert [same for same, _, _ in out] == [True, True], out
    assert all(ok and "receive hook of an earlier call has not run" in msg for _, ok, msg in out), out


def test_decode_steps_replay_the_last_calls_plan_gpu():
    """modes/low_latency/replay.py with compiled kernels (2 processes sharing the GPU): as on CPU, the replayed
    launches give the oracle's results and every case that takes the general path does."""
    out = ok_results(run_ranks(ll_cases.replayed_calls, 2, "cuda", backend="gloo"))
    for rank, (d, c, err) in enumerate(out):
        assert (d, c) == (6, 9), (rank, d, c)
        assert err == ("ValueError" if rank == 1 else "EPRemoteError"), (rank, err)
