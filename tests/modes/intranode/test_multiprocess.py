"""Real rank processes on CPU: POSIX shared-memory buffers, gloo bootstrap, host barriers with timeouts."""
import pytest
from hypothesis import given, settings, strategies as st

from tests.cases import mp as mp_cases
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _values(results):
    bad = [r for r in results if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    return results


@pytest.mark.property
@settings(max_examples=3)
@given(R=st.sampled_from([2, 3, 4]), seed=st.integers(0, 1000), H=st.sampled_from([16, 64]),
       zero_rank=st.booleans(), small=st.booleans())
def test_processes_round_trip_property(R, seed, H, zero_rank, small):
    """dispatch / combine / cached dispatch across processes, bit for bit against the reference; ragged T
    with an empty rank, and a buffer small enough to force many rounds."""
    Ts = [(0 if (zero_rank and r == 1) else 5 + 7 * r + seed % 5) for r in range(R)]
    _values(run_ranks(mp_cases.round_trip, R, seed, 4 * R, 3, H, Ts, 1024 if small else 1 << 20))


@pytest.mark.parametrize("num_nvl_bytes", [1 << 20, 1024], ids=["one round", "several rounds"])
def test_split_launches_hand_their_flags_to_the_next_launch(num_nvl_bytes):
    """Ranks as processes: the send launch leaves its round for the receive launch to publish, the receive leaves
    the freed area for the next send to release; the header's words after each call say so, on every rank."""
    R = 2
    runs = _values(run_ranks(mp_cases.header_words, R, num_nvl_bytes))
    assert [w[1:] for w in runs[0]] == [w[1:] for w in runs[1]], runs      # every rank alike
    last = 0
    for tag, base, consumed, pendc, nxt, done, done2, ready in runs[0]:
        assert base > last, (tag, base, last)
        assert (consumed, pendc, nxt, done, done2, ready) == (base - 1, base, base, 0, 0, [base] * R), (tag, runs[0])
        last = base
    if num_nvl_bytes == 1024:
        assert runs[0][0][1] > 1, "the small buffer was to force several rounds a call"


@pytest.mark.parametrize("second", ["combine", "dispatch"])
def test_another_collective_after_a_call_raises_at_once(second):
    """After a call, rank 0 makes a plain dispatch while rank 1 makes a combine (or a cached dispatch): both raise
    ValueError well within the 30 s timeout, as before the split launches left their flags to the next launch."""
    out = _values(run_ranks(mp_cases.other_collective_after_a_call, 2, second))
    assert [o[0] for o in out] == ["ValueError", "ValueError"], out
    assert all(o[1] < 15 for o in out), out


def test_send_and_receive_fused_in_one_launch():
    """Calls of one round run their send and receive as one launch (TRITON_EP_FUSED=1): plain and cached
    dispatch bit for bit against the reference, then back-to-back calls with ragged T, on 3 ranks."""
    out = _values(run_ranks(mp_cases.fused, 3, 5, 8))
    assert all(ran for _, ran in out), out


@pytest.mark.parametrize("fused", [True, False], ids=["one launch", "send and receive launches"])
def test_cached_dispatch_and_combine_replay_their_plan(fused):
    """A cached dispatch or combine of one launch with the shapes of its handle's last call replays the plan that
    call left (fresh contents, bit for bit against the reference, on 3 ranks); a non-contiguous x, weights the plan
    did not have, a tuning change, ``TRITON_EP_FUSED=0`` and the re-synchronisation after a rank's bad call take
    the general path; the ranks that replayed while one rejected its x raise ``EPRemoteError``; an x off the plan's
    16-byte alignment replays through the bound launch; ``destroy()`` drops the plans."""
    out = _values(run_ranks(mp_cases.replayed_calls, 3, 4, "cpu", fused))
    for rank, (seen, err) in enumerate(out):
        bad = rank == 1
        assert seen == [0, 6, 7, 8, 10 if bad else 11, 11 if bad else 12], (rank, seen)
        assert err == ("ValueError" if bad else "EPRemoteError"), (rank, err)


def test_a_cached_dispatch_with_a_plan_still_refuses_bad_values():
    """expert_alignment 1.0 / True and num_worst_tokens 0.0 are refused by a cached dispatch that has a plan, as by the
    general path, and the plan replays afterwards (one rank: tests/cases/mp.py says why)."""
    texts = _values(run_ranks(mp_cases.refused_values_with_a_plan, 1, 4))[0]
    assert len(texts) == 3 and all("must be an int" in t for t in texts), texts


@pytest.mark.parametrize("fused", [False, True], ids=["send and receive launches", "one launch"])
def test_calls_of_several_rounds_replay_every_launch(fused):
    """A buffer of 4 KiB (1 KiB rounded up) and 40-45 tokens a rank: every call takes several rounds; cached
    dispatches and combines replay all their launches (bit for bit against the reference; the combine with fresh
    fp32 sums each call, without and then with weights, each plan's first call on the general path). ``fused``
    (``TRITON_EP_FUSED=1``): every call, the plain dispatch too, runs all its rounds as one launch."""
    for disp, comb in _values(run_ranks(mp_cases.replayed_rounds, 2, 6, 1024, fused)):
        assert (disp, comb) == (5, 4), (disp, comb)


def test_layouts_of_the_same_shape_replay_their_launches():
    """``get_dispatch_layout`` replays the last layout's launches for a ``topk_idx`` of its shape and dtype: fresh
    routing each call against the reference (one block, several blocks, atomic counts), the dispatch given that
    layout too; another dtype, a non-contiguous ``topk_idx`` and a tuning change take the general path once."""
    for n in _values(run_ranks(mp_cases.replayed_layouts, 2, 3)):
        assert n == 18, n      # 24 layouts: 6 on the general path (the first, int32, non-contiguous, 3 tuning changes)


def test_a_kept_handle_keeps_nothing_of_a_dropped_buffer():
    """A handle whose calls were replayed, kept after its Buffer was dropped without destroy(): the Buffer's Runtime
    and shared data area are collected, the plans' launches dropped (found by a review: the launches' saved
    arguments held the data area)."""
    for out in _values(run_ranks(mp_cases.replay_plans_let_a_dropped_buffer_go, 2)):
        assert out == (True, True, True), out


@pytest.mark.parametrize("which, name", [("fused", "TRITON_EP_FUSED"), ("pdl", "TRITON_EP_PDL")])
def test_a_bad_switch_is_an_argument_error(which, name):
    """TRITON_EP_FUSED=maybe, or TRITON_EP_PDL=2: ValueError on every rank for a plain dispatch, a cached dispatch
    and a combine, before anything runs (the combine leaves its input as it was); the same Buffer goes on once the
    value is fixed."""
    for msgs, same in _values(run_ranks(mp_cases.bad_switch, 2, which)):
        assert len(msgs) == 3 and all(f"{name} must be 1 or 0" in m for m in msgs), msgs
        assert same


def test_processes_fp8():
    _values(run_ranks(mp_cases.round_trip, 2, 3, 8, 2, 256, [9, 4], 1 << 20, True))


def test_absent_peer_times_out_then_recovers():
    """A rank that never calls dispatch: every other rank raises a timeout naming itself, the peer and the
    stage within the bound, and the same processes then rebuild a Buffer and dispatch correctly."""
    out = _values(run_ranks(mp_cases.absent_peer, 3, 2.0))
    for rank in (0, 1):
        name, is_rt, is_to, r, peer, stage, waited, msg = out[rank]
        assert name == "EPTimeoutError" and is_rt and is_to
        assert (r, peer) == (rank, 2) and stage.startswith("dispatch")
        assert 2.0 <= waited < 20, waited
        assert f"rank {rank}" in msg and "peer 2" in msg
    assert out[2] is None


@pytest.mark.parametrize("kind,local,remote", [("bad_ids", "ValueError", "EPRemoteError"),
                                               ("row_bytes", "ValueError", "EPRemoteError"),
                                               ("not_tensor", "TypeError", "EPRemoteError"),
                                               ("worst", "EPCapacityError", "EPCapacityError"),
                                               ("worst_not_tensor", "TypeError", "EPRemoteError"),
                                               ("worst_mixed", "ValueError", "ValueError"),
                                               ("worst_one", "ValueError", "ValueError")])
def test_bad_input_raises_on_every_rank(kind, local, remote):
    """Rank 1's input is bad (or its num_worst_tokens too small, or 0 where the others pass one): every rank
    raises at once (well within timeout_s = 30 s), naming rank 1 or the disagreement, and a correct dispatch
    then works on the same Buffer (mp_cases.bad_input_on_one_rank)."""
    out = _values(run_ranks(mp_cases.bad_input_on_one_rank, 3, kind))
    assert out[1][0] == local, out
    assert all(o[2] < 10.0 for o in out), out
    if kind == "worst":     # rank 1's value is too small: every rank names rank 1, with rank 1's value
        assert all(o[0] == remote and "rank 1 receives" in o[1] and "num_worst_tokens=1;" in o[1]
                   for o in out), out
    elif kind in ("worst_mixed", "worst_one"):
        # ranks that disagree on whether num_worst_tokens is given (on rank 1 only, or on all but rank 1): a
        # disagreement, ValueError on every rank (docs/design.md's table), each naming what rank 1 called (before:
        # the ranks that did not find it raised EPRemoteError)
        called = "dispatch" if kind == "worst_mixed" else "dispatch with num_worst_tokens"
        assert all(out[r][0] == remote and f"rank 1 called {called}" in out[r][1] for r in (0, 2)), out
        assert "the operation: rank 1 called" in out[1][1], out
    else:
        assert all(out[r][0] == remote and "rank 1" in out[r][1] for r in (0, 2)), out


def test_ranks_sending_different_dtypes_raise_on_every_rank():
    """Any dtype moves, but all ranks must send the same one: rank 1 sends float32 rows where the others
    send bf16, and every rank raises ValueError naming the disagreement; nothing is reinterpreted."""
    out = _values(run_ranks(mp_cases.bad_input_on_one_rank, 3, "mixed_dtypes"))
    assert all(o[0] == "ValueError" and "all ranks must agree" in o[1] for o in out), out
    assert "x dtype: rank 1 passed float32, rank " in out[1][1] and "passed bfloat16" in out[1][1], out
    for r in (0, 2):        # the ranks that agree name the one that differs, whoever told them first
        assert f"x dtype: rank {r} passed bfloat16, rank 1 passed float32" in out[r][1], out


def test_ranks_passing_configs_of_different_rounds_raise_on_every_rank():
    """Rank 1 passes a Config of one row a round, the others none (one round): every rank raises ValueError at
    once, and the message says that Configs of different rounds are among the causes (before: only 'called
    different operations or passed different arguments')."""
    out = _values(run_ranks(mp_cases.bad_input_on_one_rank, 3, "config"))
    assert all(o[0] == "ValueError" and o[2] < 10.0 for o in out), out
    assert all("such as Configs that take the call in different rounds" in o[1] for o in out), out


def test_rank_missing_at_construction_times_out():
    """A rank that never builds its Buffer: the others raise EPTimeoutError naming the bootstrap stage
    within the bound instead of waiting for the process group's own (30 min) timeout."""
    out = _values(run_ranks(mp_cases.absent_at_construction, 3, 2.0))
    for stage, waited in out[:2]:
        # the first rank to give up (after its 2 s) tells the other, which may raise a little before its own
        # bound ran out (it started waiting later): both raise near the bound, neither waits it out twice
        assert stage.startswith("bootstrap") and 1.5 <= waited < 20, (stage, waited)


@pytest.mark.parametrize("subgroup", [pytest.param(False, marks=pytest.mark.extended), True])
def test_rank_that_never_builds_leaves_nothing_pending(tmp_path, subgroup):
    """Rank 1 never builds its Buffer and stays alive: rank 0 raises EPTimeoutError within the bound naming
    rank 1, then destroy_process_group() returns at once and its process exits (before: the bootstrap's
    all-gather stayed pending and both waited for gloo's own 30-minute timeout); also over a subgroup."""
    out = _values(run_ranks(mp_cases.never_builds, 3 if subgroup else 2, 2.0, str(tmp_path / "pid"), subgroup))
    stage, peers, msg, waited, destroy_s = out[0]
    assert stage.startswith("bootstrap") and peers == [1] and "peer 1 " in msg and "None" not in msg, out
    assert 2.0 <= waited < 10 and destroy_s < 5, out
    assert out[1] == "rank 0 exited", out


def test_rank_rejecting_its_arguments_tells_the_peers_at_once():
    """Rank 1's bad num_nvl_bytes travels in the set-up exchange: both ranks raise its ValueError at once."""
    out = _values(run_ranks(mp_cases.rejects_its_arguments, 2))
    for kind, seconds, msg in out:
        assert kind == "ValueError" and msg.startswith("rank 1: num_nvl_bytes") and seconds < 10, out


def test_rank_failing_mid_call_never_yields_wrong_data():
    """A rank that fails after meeting its peers (out of memory, an interrupt) must not later meet them at
    a wrong step (a bug would let the peer return another call's rows as success): it tells the peer,
    which raises EPRemoteError at once instead of waiting out its timeout, and the failed rank's Buffer
    refuses further calls."""
    out = _values(run_ranks(mp_cases.fail_mid_call, 2))
    assert out[0] == ["RuntimeError", "EPError"], out
    assert out[1][0] == "EPRemoteError", out


def test_a_peer_failing_mid_call_cuts_the_later_rounds_short():
    """A combine and a dispatch of many rounds where rank 0 fails in its second round: rank 1 raises EPRemoteError
    after the round its kernels saw that in, not after launching every later round (a call of num_worst_tokens
    rows may have millions; on the CPU each round is two interpreted launches)."""
    out = _values(run_ranks(mp_cases.fail_mid_call_of_rounds, 2))
    for (good, failed, how), phase in zip(out[1], ("combine", "dispatch")):
        assert good >= 8, (phase, out)              # (the buffer makes the call take many rounds)
        # (1 send launch: seen once in a fresh-clone CI run, the combine's round-0 kernels already saw rank 0 leave;
        # 3: round 2's send launched before its kernels saw it)
        assert how == "EPRemoteError" and 1 <= failed <= 3, (phase, out)
    assert [how for _, _, how in out[0]] == ["RuntimeError", "RuntimeError"], out


def test_destroy_from_another_thread_ends_a_waiting_dispatch():
    """destroy() from another thread while a plain dispatch waits for a late peer: the dispatch raises EPError
    'this Buffer was destroyed' (before: an internal AttributeError), once its kernel's wait has ended (here when
    the peer comes; on the CPU the interpreted kernel of the other thread runs on, within timeout_s); the late peer
    learns that rank 0 destroyed its Buffer."""
    (kind, msg, took), (kind1, msg1) = _values(run_ranks(mp_cases.destroy_from_another_thread, 2, 2.0, 0.5))
    assert (kind, "this Buffer was destroyed" in msg) == ("EPError", True), (kind, msg)
    assert took < 15.0, took                        # (within the Buffer's timeout_s of 20 s)
    assert kind1 == "EPRemoteError" and "rank 0" in msg1 and "destroyed" in msg1, (kind1, msg1)


def test_worst_outputs_out_of_memory_is_a_refused_call():
    """A num_worst_tokens dispatch whose outputs rank 0 cannot allocate: refused on every rank before anything
    moves (rank 0 raises the allocator's error, its peer EPRemoteError), and the Buffer goes on (before: rank 0
    failed in the middle of the call and both Buffers had to be rebuilt)."""
    out = _values(run_ranks(mp_cases.worst_outputs_out_of_memory, 2))
    assert out == [("RuntimeError", True), ("EPRemoteError", True)], out


def test_handles_of_different_dispatches_are_rejected_on_every_rank():
    """Each rank passes a valid handle of this Buffer, but from different dispatches: combine and cached
    dispatch raise on every rank (a bug would combine garbage silently)."""
    out = _values(run_ranks(mp_cases.mixed_handles, 2))
    assert out == [["ValueError: True"] * 2] * 2, out


def test_peer_failing_late_in_building_is_named_as_an_error_not_a_destroy():
    out = _values(run_ranks(mp_cases.peer_fails_late_in_building, 2))
    assert out[1][:2] == ("RuntimeError", out[1][1]) and "injected" in out[1][2], out
    kind, seconds, msg = out[0]
    assert kind == "EPRemoteError" and seconds < 10, out
    assert "rank 1 released its Buffer after an error of its own" in msg and "destroy())" not in msg, out


def test_peer_failing_to_build_its_buffer_is_a_remote_error_not_a_timeout():
    out = _values(run_ranks(mp_cases.peer_fails_to_build, 2))
    assert out[1][0] != "built", out
    assert out[0][0] == "EPRemoteError" and "rank 1 failed to build its Buffer" in out[0][2] and out[0][1] < 10, out


def test_peer_interrupted_while_building_its_buffer_is_a_remote_error_not_a_timeout():
    """A rank interrupted (KeyboardInterrupt) in Buffer() while its peer is late: the peer raises EPRemoteError
    naming the interrupt as soon as it arrives, not EPTimeoutError after timeout_s (30 s)."""
    out = _values(run_ranks(mp_cases.peer_interrupted_while_building, 2))
    assert out[1][0] == "KeyboardInterrupt", out
    assert out[0][0] == "EPRemoteError" and "interrupted" in out[0][2] and out[0][1] < 10, out


def test_a_bad_call_on_every_rank_leaves_the_peers_earlier_call_alone():
    """All ranks make the same invalid call right after a valid one that a late peer is still running:
    the late peer's valid call is not failed by the other rank's rejection of the next one; every valid
    call returns the right result and every invalid one raises its own argument error."""
    out = _values(run_ranks(mp_cases.bad_call_after_valid, 2))
    for o in out:
        assert all(v is True for k, v in o if k == "same"), o
        calls = [(k, v) for k, v in o if k != "same"]
        assert all(v == "ok" for k, v in calls if not k.startswith("bad")), o
        assert all(v in ("TypeError", "ValueError") for k, v in calls if k.startswith("bad")), o


def test_combine_weights_of_another_width_on_one_rank_are_a_shape_error():
    """Rank 1 passes combine weights of 1 column where the handle's dispatch took 2, the others none: a shape
    error on rank 1 (ValueError naming topk_weights and the handle's 2 columns), EPRemoteError naming rank 1 on
    the other, at once; then a correct combine works (mp_cases.combine_weights_of_another_width). (With 3 ranks a
    third rank may name rank 0, which passed the failure on: a combine's failure word does not carry the rank it
    came from.)"""
    out = _values(run_ranks(mp_cases.combine_weights_of_another_width, 2))
    assert out[1][0] == "ValueError" and "topk_weights must have shape [" in out[1][1], out
    assert ", 2] (" in out[1][1] and "2 top-k columns" in out[1][1] and ", 1]" in out[1][1], out
    assert out[0][0] == "EPRemoteError" and "rank 1 failed the call" in out[0][1], out
    assert all(o[2] < 10.0 for o in out), out
