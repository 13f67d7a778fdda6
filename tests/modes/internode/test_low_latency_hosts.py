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


def test_errors_raise_everywhere_at_once_and_the_group_recovers():
    """Rank 0 rejects its arguments (TypeError there), then rank 1 passes bad ids (ValueError there): the
    other ranks raise EPRemoteError naming the culprit well within the timeout (the failure travels in the
    call's chunk), and the next round trip on every rank matches the oracle (the group met through its store
    and restarted the call numbers, each peer's chunk numbers going on)."""
    out = _values(run_ranks(ll_cases.across_hosts, 3, _env(1), "rejected_across_hosts", 8, 128, 6))
    assert out[0]["dtype"][0] == "TypeError" and out[1]["ids"][0] == "ValueError", out
    for r, o in enumerate(out):
        assert o["first"] and o["after_dtype"] and o["after_ids"], o
        if r != 0:
            assert o["dtype"][0] == "EPRemoteError" and "rank 0" in o["dtype"][1], o
        if r != 1:
            assert o["ids"][0] == "EPRemoteError" and "rank 1" in o["ids"][1], o
        assert o["dtype_s"] < 10 and o["ids_s"] < 10, o


@pytest.mark.parametrize("allow_nvlink", [True, False])
def test_same_host_peers_take_the_shared_buffer_with_allow_nvlink(allow_nvlink):
    """2 hosts of 2 ranks, every rank sending to every rank: with allow_nvlink_for_low_latency_mode the network
    leg carries bytes to the other host's ranks only (the same-host peer is written through the shared
    buffer); without it, to all three peers. The results are the oracle's either way."""
    out = _values(run_ranks(ll_cases.across_hosts, 4, _env(2), "peers_on_network", allow_nvlink))
    for r, peers in enumerate(out):
        other_host = [p for p in range(4) if p // 2 != r // 2]
        assert peers == (other_host if allow_nvlink else [p for p in range(4) if p != r]), out


@pytest.mark.parametrize("by_timeout", [False, True])
def test_masked_remote_rank(by_timeout):
    """3 hosts of 1 rank; rank 2 builds the Buffer and falls silent. With enable_shrink the others mask it
    (explicitly, or after one timeout of 2 s): exactly its tokens and experts' entries are dropped, later calls
    do not wait for it, and it cannot be unmasked across hosts."""
    out = _values(run_ranks(ll_cases.across_hosts, 3, _env(1), "silent_peers", (2,), by_timeout))
    for status, waits, unmask in out[:2]:
        assert status == [0, 0, 1], out
        assert unmask and "cannot be unmasked" in unmask, out
        if by_timeout:
            assert waits[0] >= 2.0 and max(waits[1:]) < 1.5, waits


def test_masked_dead_host():
    """2 hosts of 2 ranks; both ranks of host 1 fall silent: host 0's ranks mask the whole host after one
    timeout and go on between themselves, results the oracle's without host 1's experts."""
    out = _values(run_ranks(ll_cases.across_hosts, 4, _env(2), "silent_peers", (2, 3), True))
    for status, waits, unmask in out[:2]:
        assert status == [0, 0, 1, 1], out
        assert max(waits[1:]) < 1.5, waits


def test_signal_after_rows_on_one_qp_and_the_planted_variant_fails():
    """Over a fabric that reorders requests across QPs, every chunk is complete when its signal arrives (each
    chunk's signal travels after its rows on the same QP) and the round trips match the oracle. The planted
    variant that posts the signal on another QP fails that check."""
    env = dict(_env(1), TRITON_EP_EMULATED_REORDER_S="0.02")
    for failed, bad, probed in _values(run_ranks(ll_cases.across_hosts, 2, env, "ordering", False)):
        assert failed is None and bad == 0 and probed >= 20, (failed, bad, probed)
    out = _values(run_ranks(ll_cases.across_hosts, 2, env, "ordering", True))
    assert sum(bad for _, bad, _ in out) > 0, out
