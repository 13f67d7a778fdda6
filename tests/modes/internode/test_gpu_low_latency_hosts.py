"""GPU tests of low-latency mode across hosts (marker ``gpu``): processes on one GPU standing in for 2 hosts
(``TRITON_EP_RANKS_PER_HOST``) over the emulated RDMA fabric, the rings in pinned host memory the kernels
reach directly. The same oracle as within one host, bit for bit: CUDA-graph capture with 100 replays of
fresh routing (the proxy runs beside the graph), and the receive hook with compute between send and receive."""
import pytest

from tests.cases import ll as ll_cases
from tests.cases.helpers import ok_results
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.gpu


def _env(per_host, arrival=False):
    """``arrival``: chunks signalled by arrival words the receive polls (``TRITON_EP_LL_ARRIVAL_WORDS``)."""
    return {"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated",
            "TRITON_EP_LL_ARRIVAL_WORDS": "1" if arrival else "0"}


@pytest.mark.parametrize("use_fp8,arrival", [(False, False), (True, False), (True, True)])
def test_graph_capture_and_100_replays_across_hosts(use_fp8, arrival):
    out = ok_results(run_ranks(ll_cases.across_hosts, 2, _env(1, arrival), "gpu_graph_replay", use_fp8, 100, 16, 4,
                               256, 24, 32, backend="gloo"))
    assert out == [100, 100], out


def test_graph_replays_two_hosts_of_two_ranks():
    out = ok_results(run_ranks(ll_cases.across_hosts, 4, _env(2), "gpu_graph_replay", True, 20, 16, 4, 256, 24, 32,
                               backend="gloo"))
    assert out == [20] * 4, out


def test_hook_with_compute_across_hosts():
    out = ok_results(run_ranks(ll_cases.across_hosts, 2, _env(1), "gpu_hook_overlap", 16, 4, 512, 40, 64,
                               backend="gloo"))
    assert out == [True, True], out


def test_masked_silent_host_on_gpu():
    """2 hosts of 2 ranks on one GPU; host 1's ranks fall silent: host 0's ranks mask both after one timeout
    (the kernels' mask words and the proxy's MASKED words) and go on between themselves, bit for bit the
    oracle without host 1's experts."""
    out = ok_results(run_ranks(ll_cases.across_hosts, 4, _env(2), "silent_peers", (2, 3), True, "cuda",
                               backend="gloo"))
    for status, waits, unmask in out[:2]:
        assert status == [0, 0, 1, 1] and waits[0] >= 4.0 and max(waits[1:]) < waits[0] - 2.0, out


def test_masked_rank_comes_back_and_is_unmasked_on_gpu():
    """Hosts of 1 rank on one GPU; rank 2 stays silent while the others mask it after one timeout and go on
    without it, then it comes back and every rank unmasks it (low_latency_clean_mask_buffer, a collective
    across hosts): the pairs renumber their rings and the round trips that follow include it, bit for bit the
    oracle's; different unmask calls then raise ValueError everywhere."""
    out = ok_results(run_ranks(ll_cases.across_hosts, 3, _env(1), "recovering_peer", 2, True, "clean", 4.0, "cuda",
                               backend="gloo"))
    for r, (before, after, mismatch) in enumerate(out):
        assert before == (None if r == 2 else [0, 0, 1]), out
        assert after == [0, 0, 0], out
        assert mismatch and "different" in mismatch, out
