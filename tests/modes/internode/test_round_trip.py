"""Internode normal mode across processes (one machine standing in for several hosts, the emulated RDMA
fabric): dispatch bit-exact against the reference, combine bit-exact against the reference's two-level
summation order, cached dispatch, num_worst_tokens, FP8 pairs, biases."""
import os

import pytest

from tests.cases import internode as cases
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
    (4, 2, [5, 0, 9, 3], {"no_topk": True}),              # routed by is_token_in_rank, without topk_idx
])
def test_round_trip(world, per_host, Ts, kw):
    out = _values(run_ranks(cases.round_trip, world, _env(per_host), 5 + world, 4 * world, 3, 64, Ts, kw,
                            timeout_s=240))
    assert all(o["combined"] for o in out), out
    assert sum(o["rows"] for o in out) > 0


def test_three_hosts_of_three_ranks():
    """The one test with 3 hosts of 3 ranks (9 processes): dispatch, combine with weights and biases, and
    cached dispatch bit-exact against the reference, skew to the first host's experts."""
    out = _values(run_ranks(cases.round_trip, 9, _env(3), 29, 18, 2, 16, [3, 0, 2, 4, 1, 2, 0, 3, 2],
                            {"bias": True, "skew": True}, timeout_s=300))
    assert all(o["combined"] for o in out), out


def test_records_straddle_chunks_over_many_rounds():
    """Chunks of 128 bytes, 2 slots per peer: every record (192 bytes) straddles two chunks and each call
    moves its records in many rounds of the ring kernels (pack, unpack) with credits between them; results
    stay bit-exact."""
    env = dict(_env(2), TRITON_EP_RDMA_CHUNK_BYTES="128", TRITON_EP_RDMA_SLOTS="2")
    out = _values(run_ranks(cases.round_trip, 4, env, 17, 16, 3, 64, [7, 5, 0, 9], {"bias": True}, timeout_s=240))
    assert all(o["combined"] for o in out), out
    assert sum(o["rows"] for o in out) > 0


def test_fp8_pairs_across_hosts():
    out = _values(run_ranks(cases.round_trip, 2, _env(1), 3, 8, 2, 256, [5, 4], {"fp8": True}, timeout_s=240))
    assert all(o["rows"] >= 0 for o in out)


def test_traffic_spreads_over_every_qp_and_both_ports():
    """A dual-port emulated NIC per rank, 4 QPs per peer: every QP carries chunks, both ports carry bytes,
    and the ports' bytes differ by at most one chunk (64 KiB) on each rank."""
    out = _values(run_ranks(cases.traffic, 2, _env(1), 512, 1024, timeout_s=240))
    for r, st in enumerate(out):
        assert st["transport"] == "emulated" and st["num_hosts"] == 2
        assert len(st["qps"]) == 4 and all(q["chunks"] > 0 for q in st["qps"].values()), st["qps"]
        ports = list(st["ports"].values())
        assert len(ports) == 2 and min(ports) > 0, st["ports"]
        assert max(ports) - min(ports) <= 1 << 16, st["ports"]
        assert sum(c["bytes"] for c in st["channels"].values()) == sum(ports)
        assert st["exchanges"] == 3 and st["network_s"] > 0


def test_rank_that_stops_calling_is_named_within_the_bound():
    """Rank 1 (host 1) builds its Buffer and then calls nothing: rank 0's dispatch raises EPTimeoutError
    within the bound, naming rank 1, host 1 and the stage; its next call raises at once. Nothing is left
    behind (QPs, MRs, threads, /dev/shm: the autouse fixture and the ranks' exits)."""
    out = _values(run_ranks(cases.failure, 2, _env(1), "stalled", 2.0, timeout_s=120))
    assert out[1] is None
    kind, msg, dt, kind2, msg2, dt2 = out[0]
    assert kind == "EPTimeoutError" and "peer 1" in msg and "host(s) 1" in msg and "tail" in msg, msg
    assert dt < 2.0 + 5.0, dt
    assert kind2 is not None and dt2 < 1.0, (kind2, dt2)


def test_qp_in_error_state_fails_both_ranks_naming_qp_and_channel():
    """Rank 0's QP 1 towards host 1 goes into the error state. The rank whose proxy sees it first (rank 0: its
    posts on QP 1 flush; or rank 1: its writes on QP 1 are not acknowledged, retry exceeded) raises
    ProxyError at the send completion, naming QP 1, its channel and the peer; it tells the other through its
    fault word (ProxyRemoteError), unless that one saw the QP itself. Both within the bound; later calls raise
    at once."""
    out = _values(run_ranks(cases.failure, 2, _env(1), "broken_qp", 3.0, timeout_s=120))
    k0, m0, d0, k0b, _, d0b = out[0]
    k1, m1, d1, k1b, _, d1b = out[1]
    assert "ProxyError" in (k0, k1) and {k0, k1} <= {"ProxyError", "ProxyRemoteError"}, (k0, k1)
    assert "QP 1" in m0 and "channel" in m0 and "rank 1 on host 1" in m0 and "send completion" in m0, m0
    assert "QP 1" in m1 and "rank 0 on host 0" in m1 and "send completion" in m1, m1
    if k0 == "ProxyError":
        assert "IBV_WC_WR_FLUSH_ERR" in m0, m0
    assert max(d0, d1) < 3.0 + 5.0, (d0, d1)
    assert k0b is not None and k1b is not None and max(d0b, d1b) < 1.0


@pytest.mark.parametrize("kind", ["capacity", "bad_args"])
def test_a_failure_on_one_host_reaches_every_rank(kind):
    """num_worst_tokens too small on host 0 only: every rank of both hosts raises EPCapacityError; one rank
    rejecting its arguments: it raises TypeError, every other rank EPRemoteError, none waiting out its bound.
    Afterwards a correct dispatch and combine work on every rank."""
    out = _values(run_ranks(cases.propagation, 4, _env(2), kind, timeout_s=240))
    for r, o in enumerate(out):
        want = "EPCapacityError" if kind == "capacity" else ("TypeError" if r == 3 else "EPRemoteError")
        assert o[0] == want, (r, o)
        assert o[1] < 10.0, (r, o)            # well inside the 20 s bound
        assert o[-1] is True, (r, o)
    if kind == "bad_args":      # rank 2 hears of it in its host's forwarding leg: global rank numbers
        assert out[2][2].startswith("rank 2: rank 3 failed the call") and \
            "forwarding leg of host 1: ranks [2, 3]" in out[2][2], out[2]


@pytest.mark.property
@pytest.mark.parametrize("world,per_host", [(2, 1), (4, 2), pytest.param(6, 2, marks=pytest.mark.extended),
                                            pytest.param(6, 3, marks=pytest.mark.extended)])
def test_property_random_cases(world, per_host):
    """Random cases on one Buffer against the reference (see internode_cases.property_cases): 2 hosts of 1
    and 2 ranks, 3 hosts of 2, 2 hosts of 3. More cases with TRITON_EP_HYPOTHESIS=deep."""
    n = 40 if os.environ.get("TRITON_EP_HYPOTHESIS") == "deep" else 4
    out = _values(run_ranks(cases.property_cases, world, _env(per_host), 7 * world + per_host, n, timeout_s=600))
    assert all(o["cases"] == n for o in out)


def test_a_killed_rank_leaves_no_ring_files():
    """The emulated fabric's ring files are unlinked once every peer has mapped them (after the Buffer's
    construction): a rank killed with SIGKILL leaves nothing in /dev/shm."""
    out = run_ranks(cases.killed, 2, _env(1), timeout_s=120)
    assert isinstance(out[1], RankFailure) and "ProcessDied" in str(out[1]), out[1]
    assert not isinstance(out[0], RankFailure), out[0]
    assert out[0]["during"] == [] and out[0]["after"] == [], out[0]


def test_a_dropped_signal_fails_both_ranks_within_the_bound():
    """Rank 0's proxy leaves out the signal of its first data chunk to host 1: the chunk never completes at
    rank 0 and never counts as arrived at rank 1. Rank 0 raises ProxyError naming the chunk's QP, channel
    and peer (or its ring wait's EPTimeoutError), rank 1 hears of it (ProxyRemoteError) or times out itself;
    both within the bound, later calls at once."""
    out = _values(run_ranks(cases.failure, 2, _env(1), "dropped_signal", 3.0, timeout_s=120))
    k0, m0, d0, k0b, _, d0b = out[0]
    k1, m1, d1, k1b, _, d1b = out[1]
    assert k0 in ("ProxyError", "EPTimeoutError") and ("rank 1 on host 1" in m0 or "host(s) 1" in m0), (k0, m0)
    assert k1 in ("ProxyRemoteError", "ProxyError", "EPTimeoutError") and ("host 0" in m1 or "host(s) 0" in m1), \
        (k1, m1)
    assert max(d0, d1) < 3.0 + 5.0, (d0, d1)
    assert k0b is not None and k1b is not None and max(d0b, d1b) < 1.0, (k0b, d0b, k1b, d1b)


def test_a_rank_killed_mid_dispatch_on_the_other_host():
    """2 hosts of 2 ranks; rank 3 (host 1) dies with SIGKILL inside a dispatch, after its records went out
    and before it unpacks its peer's. Every other rank raises an EPError within two bounds (the failure
    reaches rank 0 through rank 1's forwarding leg); the ranks that wait on rank 3 directly name it (rank
    1: its RDMA peer, rank 3 on host 1, as gone (PeerGoneError: its proxy's probe of rank 3 was never
    acknowledged); rank 2: in its host's forwarding leg); later calls raise at once; nothing is left in /dev/shm
    (the autouse fixture)."""
    out = run_ranks(cases.failure, 4, _env(2), "killed", 3.0, timeout_s=120)
    assert isinstance(out[3], RankFailure) and "ProcessDied" in str(out[3]), out[3]
    for r in range(3):
        assert not isinstance(out[r], RankFailure), out[r]
        kind, msg, dt, kind2, msg2, dt2 = out[r]
        assert kind in ("EPTimeoutError", "EPRemoteError", "ProxyError", "ProxyRemoteError", "PeerGoneError"), \
            (r, kind, msg)
        assert dt < 2 * 3.0 + 8.0, (r, dt)      # (two bounds, and the interpreter's watchdog slack on a loaded CPU)
        assert kind2 is not None and dt2 < 1.0, (r, kind2, dt2)
    assert "rank 3 on host 1" in out[1][1] or "peer 3" in out[1][1], out[1][1]
    assert "rank 3" in out[2][1], out[2][1]


def test_a_rank_that_rejects_its_arguments_keeps_its_host_in_step():
    """Rank 3 (host 1) alone passes bad arguments to a dispatch, a combine and a cached dispatch: it raises
    its own error each time, every other rank EPRemoteError; it still takes its host's forwarding-leg call
    (failing at the argument check), so each host's ranks stay at the same call: a later disagreement on
    host 1 (rank 3 combines another hidden size) is a ValueError on every rank naming the field and both values
    with global rank numbers, as one call's (no "it is at call" note), and the next correct dispatch + combine works on every rank. The ranks of host 0 name
    rank 3 for the bad combine: rank 1 as its RDMA peer, rank 0 through rank 2, which passed it on."""
    out = _values(run_ranks(cases.in_step, 4, _env(2), timeout_s=240))
    for r, o in enumerate(out):
        want = "ValueError" if r == 3 else "EPRemoteError"
        assert o[:3] == [want] * 3, (r, o)
        assert o[-1] is True, (r, o)
    for r in range(4):          # a disagreement: ValueError on every rank, with global rank numbers
        assert out[r][3] == "ValueError" and "hidden: rank 2 passed 64, rank 3 passed 32" in out[r][4] and \
            "it is at call" not in out[r][4], out[r]
    assert "rank 3 (host 1) failed this call" in out[1][5], out[1][5]
    assert "rank 3 (host 1; rank 2 on host 1 passed it on)" in out[0][5], out[0][5]


def test_round_trip_with_the_default_group_bound_to_a_device():
    """DeepEP's test programs call ``init_process_group(..., device_id=...)``: the default group is bound to a device
    and torch builds subgroups by splitting its backend, which gloo cannot (on torch 2.11 the ranks outside a
    subgroup raised AttributeError in Buffer's set-up). The Buffer makes its per-host groups unbound; the round trip
    is the reference's."""
    _values(run_ranks(cases.round_trip, 2, _env(1), 3, 8, 2, 64, [5, 4], {"bound": True}))


def test_destroy_meets_the_rdma_peers_as_they_close():
    """2 hosts of 1 rank, one round trip, then rank 1 destroys its Buffer 1.5 s after rank 0: rank 0's destroy()
    waits for rank 1 to close too (so it never closes under rank 1's last writes of the call, which made rank 1's
    proxy find it gone: seen as PeerGoneError on 3 hosts of 1 rank under load), bounded (5 s); rank 1 finds rank 0
    closing and does not wait."""
    out = _values(run_ranks(cases.close_meeting, 2, _env(1), 1.5, timeout_s=240))
    (took0, waited0), (took1, waited1) = out
    assert 1.0 <= waited0 <= took0 < 5.0, out
    assert waited1 < 1.0, out
