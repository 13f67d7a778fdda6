"""Low-latency mode on CPU: real rank processes over POSIX shared memory, kernels under the interpreter.

Each test spawns 2-4 processes once and runs several cases inside (spawning costs seconds): every
result is checked against the oracle in tests/cases/ll.py."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.cases import ll as ll_cases
import triton_ep
from triton_ep.kernels.fp8 import pack_ue8m0, quantize, quantize_reference, unpack_ue8m0
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


_case = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.sampled_from(["identity", "affine"]),
                  st.booleans(), st.booleans())


@pytest.mark.property
@settings(max_examples=3)
@given(R=st.sampled_from([2, 3, 4]), seed=st.integers(0, 1000), K=st.sampled_from([1, 3, 4]),
       H=st.sampled_from([128, 512]), cases=st.lists(_case, min_size=2, max_size=4), zero_rank=st.booleans())
def test_dispatch_combine_property(R, seed, K, H, cases, zero_rank):
    """Ragged T <= N (an empty rank), -1 ids, duplicates, skew; bf16 / FP8 / round_scale / UE8M0, with
    and without hooks and zero-copy: counts are the per-expert histogram, rows are the source rows
    (bf16 bit-exact; FP8 the reference bytes and scales, within the e4m3 bound), combine is the fixed-
    order weighted sum over k of f_e(x) for identity and affine experts; the stats accumulate the counts."""
    N = 8
    E = 2 * R
    cases = [(f, rs and f, u and f and rs and H % 512 == 0, kind, hook, zc) for f, rs, u, kind, hook, zc in cases]
    Ts = [0 if (zero_rank and r == R - 1) else 1 + (seed + 3 * r) % N for r in range(R)]
    _values(run_ranks(ll_cases.round_trip, R, seed, E, K, H, Ts, N, cases))


def test_control_words_without_and_with_hooks():
    """Calls without a hook skip the send's end-of-launch count (the receive publishes the call), receives skip
    theirs (the next launch releases CONS): the words after each step, with 2 ranks. READY[h][s] is checked where
    it is settled: a rank's own entry always, a peer's once a receive of that half waited for it."""
    R = 2
    # step: SEQ, NEXT, PEND[0], PEND[1], CONS[0], CONS[1], DONE, {half: (value, peers settled)}
    want = {
        # (half 0 is free from the start: a peer's combine 2 may already have written its entry there, 0 or 2)
        "dispatch 1": (1, 1, 0, 1, 0, 0, 0, {0: (0, False), 1: (1, True)}),
        # (combine 2's send released half 1 (CONS[1]): a peer's dispatch 3 may already have written its entry, 1 or 3)
        "combine 2 sent": (2, 1, 0, 1, 0, 1, 0, {0: (2, False), 1: (1, False)}),
        "combine 2 received": (2, 1, 2, 1, 0, 1, 0, {0: (2, True), 1: (1, False)}),
        "dispatch 4 beside 3's hook": (4, 4, 4, 1, 2, 1, 0, {0: (4, True), 1: (3, False)}),
        "dispatch 3 received": (4, 4, 4, 3, 4, 1, 0, {0: (4, True), 1: (3, True)}),
        "combine 5": (5, 5, 4, 5, 4, 3, 0, {0: (4, True), 1: (5, True)}),
    }
    for me, seen in enumerate(_values(run_ranks(ll_cases.control_words, R))):
        assert [s[0] for s in seen] == list(want), seen
        for tag, *got, ready in seen:
            w = want[tag]
            assert tuple(got) == w[:7], (me, tag, got, w[:7])
            for h, (v, settled) in w[7].items():
                row = ready[h * R:(h + 1) * R]
                assert row[me] == v, (me, tag, h, row)
                if settled:
                    assert row == [v] * R, (me, tag, h, row)


def test_two_outstanding_hooks_and_a_third_refused():
    out = _values(run_ranks(ll_cases.two_live_hooks, 2, 11, 4, 2, 128, [6, 5], 8))
    assert out == [True, True]


@pytest.mark.parametrize("by_timeout", [False, True])
def test_masked_rank_drops_exactly_its_tokens(by_timeout):
    out = _values(run_ranks(ll_cases.masked_rank, 3, 5, 6, 2, 128, [5, 6, 4], 8, 2, by_timeout))
    for status, after, waits in out[:2]:
        assert status == [0, 0, 1] and after == [0, 0, 0], (status, after)
        if by_timeout:      # one timeout (2 s), then the masked rank is not waited for again
            assert waits[0] >= 2.0 and waits[1] < 1.5, waits


@pytest.mark.parametrize("hook", [False, True])
def test_a_rank_masked_by_hand_on_one_side_masks_its_peer_visibly(hook):
    """Rank 0 masks rank 1 by hand, rank 1 masks nobody (new user's find: rank 1 silently lost rank 0's entries, its
    mask empty): rank 1 learns it from rank 0's call and masks rank 0 at once (its mask shows it), dropping exactly
    rank 0's tokens and entries; after both clean their masks a round trip is whole (tests/cases/ll.py checks every
    row)."""
    (st0, _, after0), (st1, took1, after1) = _values(
        run_ranks(ll_cases.one_sided_hand_mask, 2, 13, 4, 2, 128, [5, 6], 8, hook))
    assert st0 == [0, 1] and st1 == [1, 0], (st0, st1)
    assert after0 == after1 == [0, 0], (after0, after1)
    assert took1 < 15.0, took1          # (told, not a 30 s timeout)


@pytest.mark.parametrize("form", ["split", "hook", "fused"])
def test_rank_that_skipped_a_call_takes_no_stale_rows(form):
    """A rank that skipped a call its peers made and gave up on (new user's find: its next dispatch returned the
    peer's rows of the skipped call as its own, counted, with an empty mask): it masks the peers that gave up on it
    at once, takes none of their rows, and after every rank unmasks a round trip is correct again."""
    out = _values(run_ranks(ll_cases.skipped_call, 2, 7, 4, 2, 128, [5, 6], 8, 1, form))
    (st0, after0, _, _, _), (st1, after1, took, sources, _) = out
    assert st0 == [0, 1] and st1 == [1, 0], (st0, st1)
    assert after0 == after1 == [0, 0], (after0, after1)
    assert all(src == 1 for (_, src) in sources), sources     # rows of its own only: none of rank 0's A (or B)


def test_rank_that_calls_late_is_told_it_was_given_up_on():
    """A rank that makes a call after its peers gave up on it (late, not absent): it masks them at once in that call
    and the next (before, it took the give-up call's rows and then, at its next call, the peer's release of a call
    that sent it nothing, over an earlier call's counts, with an empty mask), and after every rank unmasks a round
    trip is correct again."""
    out = _values(run_ranks(ll_cases.skipped_call, 2, 9, 4, 2, 128, [6, 5], 8, 1, "split", True))
    (st0, after0, _, _, _), (st1, after1, _, sources, late_a) = out
    assert st0 == [0, 1] and st1 == [1, 0], (st0, st1)
    assert after0 == after1 == [0, 0], (after0, after1)
    assert all(src == 1 for (_, src) in sources), sources
    assert all(src == 1 for (_, src) in late_a), late_a        # (the call its peers gave up with: masked at once)


def test_silent_peer_without_shrink_times_out():
    out = _values(run_ranks(ll_cases.absent_without_shrink, 2, 8, 128, 4))
    assert out[0][0] == "EPTimeoutError" and out[0][1] == 1, out


def test_disagreeing_ranks_raise_value_error_everywhere_naming_the_field():
    out = _values(run_ranks(ll_cases.disagree_then_recover, 2, 8, 128, 4))
    for me, peer in ((0, 1), (1, 0)):
        (k0, m0), (k1, m1) = out[me]
        assert k0 == "ValueError" and f"use_fp8: rank {me} passed {me != 1}, rank {peer} passed {peer != 1}" in m0, out
        assert k1 == "ValueError" and (f"num_max_dispatch_tokens_per_rank: rank {me} passed {8 if me != 1 else 4}, "
                                       f"rank {peer} passed {8 if peer != 1 else 4}") in m1, out


def test_bad_ids_and_shapes():
    out = _values(run_ranks(ll_cases.bad_ids_then_recover, 2, 8, 128, 4))
    assert all(o[:2] == ["N: ValueError", "N: ValueError"] for o in out), out    # a str N (as every size), N = 0
    assert out[1][2:4] == ["shape", "ValueError (2 ids)"], out
    assert out[0][2] == "shape" and "EPRemoteError" in out[0][3:], out
    # a float32 out, a bf16 of T+1, a non-contiguous bf16 [T, H] (a new user's find: its message read "got
    # torch.bfloat16 [8, 128]", the same as the requirement)
    assert all(o[-5:-2] == ["out: TypeError", "out: ValueError", "out: ValueError (non-contiguous)"] for o in out), out
    # (a new user's find: a non-contiguous stats tensor was told "got (4,) on cpu", what was required)
    for o in out:
        assert o[-2:] == [
            "ValueError: cumulative_local_expert_recv_stats must be a contiguous tensor of shape (2,) on cpu, got a "
            "non-contiguous tensor of shape (2,) (strides (2,)) on cpu",
            "ValueError: dispatch_wait_recv_cost_stats must be a contiguous tensor of shape (2,) or (2, 2) on cpu, got "
            "a non-contiguous tensor of shape (2,) (strides (2,)) on cpu"], o
    want = "handle must be a handle this Buffer's low_latency_dispatch returned"
    for o in out:       # (a new user's find: a float in a handle's place said "got tuple")
        assert [e for e in o if e.startswith("handle: ")] == [
            "handle: TypeError: handle[3] (hidden) must be an int, got float",
            f"handle: ValueError: {want}; a list of 4 entries is not one (it holds 5: src_info, layout_range, "
            "num_max_dispatch_tokens_per_rank, hidden, num_experts)",
            f"handle: TypeError: {want}, got a tuple of its entries: the handle itself also keeps, on the host, what "
            "its cached calls need; pass it as it was returned"], o


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_kernel_matches_reference(round_scale):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 512, generator=g) * torch.rand(40, 1, generator=g) * 50).to(torch.bfloat16)
    x[2] = 0
    q, s = quantize(x, round_scale)
    qr, sr = quantize_reference(x, round_scale)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    if round_scale:
        assert torch.equal(unpack_ue8m0(pack_ue8m0(s)), s)


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_keeps_nan_and_inf_as_the_reference(round_scale):
    """A block holding a NaN gets a NaN scale and NaN values (not a finite -448); an infinite value makes
    its block's scale infinite: bytes and scales as the reference's (NaN where it has NaN)."""
    x = torch.randn(3, 256).to(torch.bfloat16)
    x[0, 5], x[1, 200], x[2, 7] = float("nan"), float("inf"), -float("inf")
    q, s = quantize(x, round_scale)
    qr, sr = quantize_reference(x, round_scale)
    assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s[~s.isnan()], sr[~sr.isnan()])
    assert s[0, 0].isnan() and s[1, 1].isinf() and q[0, :128].float().isnan().all()
    same = (q.view(torch.uint8) == qr.view(torch.uint8)) | (q.float().isnan() & qr.float().isnan())
    assert same.all()


_NAN_CAST = """
import torch
from triton_ep.kernels.fp8 import quantize
x = torch.randn(2, 256).to(torch.bfloat16)
x[0, :] = float("nan")                      # a row of NaN only: its blocks' amax reduces NaN alone
q, s = quantize(x, False)
print("scales", s[0].isnan().all().item(), s[1].isfinite().all().item())
"""


def test_fp8_cast_of_a_nan_row_prints_no_interpreter_warning():
    """Under the interpreter an FP8 cast of a row of NaN only (kept NaN on purpose) prints none of numpy's warnings
    (``All-NaN slice encountered``, ``invalid value encountered``): triton_mode filters those of Triton's interpreter
    alone. A process of its own: pytest shows warnings its own way."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="default")
    out = subprocess.run([sys.executable, "-c", _NAN_CAST], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert "scales True True" in out.stdout
    assert "Warning" not in out.stderr, out.stderr[-1500:]


@pytest.mark.parametrize("H", [384, 640])
def test_hidden_a_multiple_of_128_but_not_a_power_of_two(H):
    """Hidden 384 or 640 (a multiple of 128, below the send kernel's block): bf16 and FP8 round trips are the
    reference's (the send's block was once 384 wide, which Triton refuses: a block must be a power of two)."""
    _values(run_ranks(ll_cases.round_trip, 2, 5, 4, 2, H, [3, 5], 8,
                      [(False, False, False, "affine", False, False), (True, False, False, "identity", False, False)]))


@pytest.mark.parametrize("H", [2880, 200])
def test_bf16_hidden_of_16_byte_rows(H):
    """bf16 low-latency calls take any hidden whose row is a multiple of 16 bytes: gpt-oss's 2880 (not a multiple
    of 128) and 200 (a send block of 8 channels), with and without a hook, against the reference."""
    _values(run_ranks(ll_cases.round_trip, 2, 7, 4, 2, H, [3, 5], 8,
                      [(False, False, False, "affine", False, False), (False, False, False, "identity", True, False)]))


def test_hidden_sizes_no_call_takes_are_refused():
    """FP8 calls and LogFMT combines refuse a hidden that is not a multiple of 128 (their blocks), naming use_fp8 /
    use_logfmt and hidden (a LogFMT combine at 2880 once corrupted memory); bf16 calls one whose rows are not a
    multiple of 16 bytes; the size hint accepts every hidden some call takes and
    refuses the others. Checked on every rank before anything launches; the next call works."""
    for msg in _values(run_ranks(ll_cases.hidden_refusals, 2)):
        assert msg == ["use_fp8=True", "hidden % 8 == 0", "not a multiple of 8", "logfmt refused", "ok"], msg


def test_more_top_k_columns_than_experts_is_refused():
    """top-k wider than num_experts would return more rows to a source than a half of the area holds (DeepEP's
    top-k picks distinct experts): ValueError on every rank before anything launches, and the next call works."""
    out = _values(run_ranks(ll_cases.wide_topk, 2))
    assert all("more than num_experts=4" in msg for msg, _ in out), out
    assert sum(rows for _, rows in out) == 8, out


def test_a_call_of_other_sizes_waits_for_a_slow_peer():
    """Rank 1 holds its combine's hook while rank 0 goes on to a dispatch of smaller N, whose half of the area
    lies over the half rank 1 still has to reduce: both results equal the oracle (before the first call of new
    sizes waited for every peer's last receive, rank 1's combine came out wrong). Other sizes while a hook is
    pending are refused with ValueError."""
    out = _values(run_ranks(ll_cases.size_change, 2))
    assert [same for same, _, _ in out] == [True, True], out
    assert all(dispatched and "receive hook of an earlier call has not run" in msg for _, dispatched, msg in out), out


def test_size_hint_and_argument_errors():
    assert triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) % 128 == 0
    with pytest.raises(ValueError):
        triton_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 3, 256)


def test_a_bad_call_on_every_rank_leaves_a_late_hook_alone():
    """A peer rejecting the next low-latency call does not fail this rank's receive of the previous one
    (the failure word names the call it belongs to); the group goes on after the rejected call."""
    out = _values(run_ranks(ll_cases.bad_call_after_valid, 2, 4, 128, 4))
    for rank, o in enumerate(out):
        calls = [(k, v) for k, v in o if k != "final rows"]
        assert all(v == "ok" for k, v in calls if k != "bad") and len(calls) == 5, o
        assert all(v == "TypeError" for k, v in calls if k == "bad"), o
        # 3 tokens from each of 2 ranks reach expert 0 (rank 0) and expert 3 (rank 1)
        assert [v for k, v in o if k == "final rows"] == [[6, 0] if rank == 0 else [0, 6]], o


@pytest.mark.parametrize("who", ["all", "one", "badid"])
def test_a_rejected_call_then_a_normal_mode_call_then_low_latency_calls(who):
    """One Buffer of both modes within one host: after a low-latency call rejected on every rank (or on one,
    whose peer hears of it, on the host or by its kernel), a normal-mode round trip and then low-latency round
    trips all succeed with the oracle's rows (the normal-mode call's re-synchronisation restarts the low-latency
    call numbers too)."""
    out = _values(run_ranks(ll_cases.rejection_then_normal_mode, 2, 4, 128, 4, who))
    for rank, o in enumerate(out):
        got = dict(o)
        assert got["valid"] == "ok" and got["normal"] == "ok", o
        bad = who == "all" or rank == 1
        assert got["rejected"] == (("ValueError" if who == "badid" else "TypeError") if bad else "EPRemoteError"), o
        assert got["low-latency 0"] == "ok" and got["low-latency 1"] == "ok", o
        # 3 tokens from each of 2 ranks reach expert 0 (rank 0) and expert 3 (rank 1)
        assert got["counts 0"] == got["counts 1"] == ([6, 0] if rank == 0 else [0, 6]), o


@pytest.mark.parametrize("what", ["mode", "nvl"])
def test_ranks_that_disagree_on_the_low_latency_layout_fail_at_construction(what):
    """One rank without low_latency_mode, or with another num_nvl_bytes (the low-latency area would start
    elsewhere): every rank raises ValueError at construction, at once, and nothing is left behind."""
    out = _values(run_ranks(ll_cases.modes_disagree, 2, 4, 128, 4, what))
    for name, secs, text in out:
        assert name == "ValueError" and "low_latency_mode" in text and secs < 10, out
        if what == "mode":      # each side described as it is (no "area of 0 bytes" for a normal-mode rank)
            assert "low_latency_mode=False" in text and "low_latency_mode=True, a low-latency area of" in text, out


@pytest.mark.parametrize("kind", ["dtype", "badid"])
def test_a_pending_hook_and_a_failed_later_call(kind):
    """A hook of an earlier, valid call never returns wrong rows after a later call failed: it returns the
    right counts, or (where this rank's kernels were stopped by the later error) raises EPRemoteError.
    A rank that only rejected the later call on the host still receives; a late hook is not failed by a
    peer's bad ids in the next call; the call after the failure is correct on every rank."""
    out = _values(run_ranks(ll_cases.hook_then_rejection, 2, 4, 128, 4, kind))
    want = [[6, 0], [0, 6]]
    for rank, o in enumerate(out):
        d = dict(o)
        assert d["hook A"] in (want[rank], "EPRemoteError"), o
        assert d["C"] == want[rank], o
    d0, d1 = dict(out[0]), dict(out[1])
    assert d1["hook A"] == want[1], out                # rank 1's kernels were never stopped
    if kind == "dtype":
        assert d1["B"] == "TypeError" and d0["B"] == "EPRemoteError", out
    else:
        assert d0["hook A"] == want[0], out            # the late hook is not failed by rank 1's next call
        assert d1["B"] == "ValueError" and d0["B"] == "EPRemoteError", out


def test_bad_calls_on_one_rank_among_replays_and_resyncs_raise_on_every_rank():
    """Rank 1 alternates valid calls with rejected ones (float topk_idx, found before launch; ids of -3, found by
    its kernel; fp64 weights), rank 0's good calls replayed or after a re-synchronisation, rank 0 slow to restart
    its call numbers after the meeting: every bad call raises on every rank at once (rank 1 its own error, rank 0
    EPRemoteError), never waits out timeout_s, and the valid calls between them are correct. (A new user's find:
    the restart cleared a failure word rank 1 had just posted, so rank 0 waited out timeout_s and the next
    re-synchronisation timed out.)"""
    out = _values(run_ranks(ll_cases.bad_calls_among_replays, 2, 0))
    want_counts = [[6, 0], [0, 6]]
    for rank, (log, _) in enumerate(out):
        for name, got, secs in log:
            if name.startswith("valid"):
                want = want_counts[rank]
            elif rank == 0:
                want = "EPRemoteError"
            else:
                want = "ValueError" if name.startswith("neg3") else "TypeError"
            assert got == want and secs < 5, (rank, name, got, secs, log)
    assert out[0][1] >= 2, out      # rank 0 replayed the dispatch beside rank 1's rejections


@pytest.mark.parametrize("at_call", [1, 4])
def test_an_interrupt_in_the_middle_of_a_call_is_named_on_every_rank_at_once(at_call):
    """SIGINT reaches rank 1 in the middle of a low-latency call (the general path's first dispatch, or a replayed
    combine): rank 1 raises KeyboardInterrupt and its next call EPError (it left the group); rank 0 raises
    EPRemoteError naming rank 1 at once, not EPTimeoutError at timeout_s (10 s), as in normal mode."""
    out = _values(run_ranks(ll_cases.interrupted_mid_call, 2, at_call))
    r0, r1 = out
    step = f"round {(at_call - 1) // 2}"
    assert [s[:2] for s in r1 if s[1] != "ok"] == [(step, "KeyboardInterrupt"), (f"round {(at_call + 1) // 2}",
                                                                                 "EPError")], r1
    bad = [s for s in r0 if s[1] != "ok"]
    assert len(bad) == 1 and bad[0][:2] == (step, "EPRemoteError") and "rank 1" in bad[0][3], r0
    assert bad[0][2] < 5, r0


@pytest.mark.parametrize("ll_rank, late", [(1, "normal"), (0, "normal"), (1, "ll"), (0, "ll")])
def test_a_low_latency_call_against_a_normal_mode_call_raises_value_error_everywhere_at_once(ll_rank, late):
    """One Buffer of both modes: one rank calls low_latency_dispatch while the other calls dispatch (both
    orders of ranks; the rank of either mode comes last, and finds the disagreement in the other's call card,
    whose waits hear of it). Every rank raises ValueError naming both calls, well within timeout_s (30 s), and a
    normal-mode and a low-latency round trip then succeed with the oracle's rows (a new user's find: every rank
    waited out timeout_s, and the Buffer was unusable after)."""
    out = _values(run_ranks(ll_cases.modes_mixed, 2, ll_rank, late))
    for rank, o in enumerate(out):
        got = dict(o)
        assert got["normal before"] == "ok", o
        kind, secs, msg = got["mixed"]
        assert kind == "ValueError" and secs < 10, o
        ll_name, normal_name = f"rank {ll_rank} called low_latency_dispatch", f"rank {1 - ll_rank} called dispatch"
        assert ll_name in msg and normal_name in msg and "disagree" in msg, o
        assert got["normal after"] == "ok" and got["low-latency after"] == "ok", o


@pytest.mark.parametrize("which", ["nvfp4", "overlap"])
def test_an_engine_fork_keyword_refused_on_one_rank_is_told_to_its_peers(which):
    """deep_ep's Buffer (the deep_ep switch's): rank 1 passes use_nvfp4=True to low_latency_dispatch or
    overlap=True to low_latency_combine. It raises NotImplementedError naming the keyword, its peer
    EPRemoteError well within timeout_s (30 s), and the next low-latency round trip succeeds on both (a new
    user's find: the peer waited out timeout_s, and the Buffer was unusable after)."""
    out = _values(run_ranks(ll_cases.fork_keyword, 2, which))
    for rank, o in enumerate(out):
        got = dict(o)
        kind, secs, msg = got["refused"]
        if rank == 1:
            assert kind == "NotImplementedError", o
            key = "use_nvfp4=True" if which == "nvfp4" else "low_latency_combine(overlap=True, block_m)"
            assert key in msg, o
        else:
            assert kind == "EPRemoteError" and secs < 10, o
        assert got["after"] == "ok", o
