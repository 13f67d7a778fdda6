"""The capture path of internode normal mode (docs/internode.md, "CUDA graphs"): num_worst_tokens calls
across hosts with no device synchronisation (a dispatch's one host wait: its RDMA peers' token counts), on CPU processes over the emulated fabric
(``TRITON_EP_INTERNODE_CAPTURE_PATH=1``; on GPU it is the default, and tests/modes/internode/test_gpu_internode.py
captures it in a CUDA graph)."""
import pytest

from tests.cases import internode as cases
from triton_ep.modes.internode.records import network_record_bytes
from triton_ep.protocol.records import NET_HEADER_WORDS
from triton_ep.testing import RankFailure, run_ranks


def _values(out):
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(str(o) for o in bad)
    return out


def _env(per_host, **more):
    return dict({"TRITON_EP_RANKS_PER_HOST": str(per_host), "TRITON_EP_RDMA": "emulated",
                 "TRITON_EP_INTERNODE_CAPTURE_PATH": "1"}, **more)


_MANY_ROUNDS = {"TRITON_EP_RDMA_CHUNK_BYTES": "128", "TRITON_EP_RDMA_SLOTS": "2"}


@pytest.mark.parametrize("world,per_host,Ts,more,per_rank", [
    # 2 hosts of 2 ranks (the default run has them in test_capture_path_different_calls_fail_at_once)
    pytest.param(4, 2, [7, 0, 9, 4], {}, False, marks=pytest.mark.extended),
    # 3 hosts, many rounds (the default run has them with per-rank num_worst_tokens, the last case)
    pytest.param(3, 1, [5, 8, 2], _MANY_ROUNDS, False, marks=pytest.mark.extended),
    # each rank its own num_worst_tokens, 2 hosts of 2 ranks, many rounds
    pytest.param(4, 2, [7, 0, 9, 4], _MANY_ROUNDS, True, marks=pytest.mark.extended),
    (3, 1, [5, 8, 2], _MANY_ROUNDS, True),
])
def test_capture_path_round_trips_and_host_path_between(world, per_host, Ts, more, per_rank):
    """num_worst_tokens dispatch, combine and cached dispatch bit for bit the reference on the capture path
    (with weights and biases; without topk_idx; skewed), with a plain dispatch on the host path between them on
    the same Buffer: the host path re-reads the chunk numbers the capture path's kernels advanced, and the plain
    dispatch's combine and cached dispatch take the capture path with its host-known counts. Records straddle
    128-byte chunks in the many-round cases. Only the plain dispatch exchanges headers. ``per_rank``: every
    rank passes its own num_worst_tokens (rank 0's exactly its rows), so the ranks' staging areas and rounds
    differ."""
    out = _values(run_ranks(cases.capture_sequence, world, _env(per_host, **more), 11, 4 * world, 3, 64, Ts,
                            per_rank, timeout_s=300))
    for o in out:
        assert all(c["combined"] for c in o[:4]), o
        # the plain dispatch alone (its header and status): its combine and cached dispatch take the capture path
        assert o[4] == 2, o
    assert sum(c["rows"] for o in out for c in o[:4]) > 0


@pytest.mark.parametrize("kind", ["bad_ids", "capacity", pytest.param("capacity_late", marks=pytest.mark.extended),
                                  pytest.param("capacity_rank", marks=pytest.mark.extended), "bad_shape"])
def test_capture_path_errors_reach_every_rank(kind):
    """A bad id on rank 3 (found on the device: the call returns, Buffer.check() raises ValueError there), a
    num_worst_tokens too small for host 0 (EPCapacityError on host 0's ranks: the forwarding leg's; also where
    rank 1 finds it, raises and leaves the host's group while rank 0 is still in the call), too small on rank 0
    alone (EPCapacityError on host 0's ranks naming rank 0, and on rank 0 its value), int64
    topk_weights on rank 3 (TypeError at once). Each ends the network leg for good: every rank's next call raises at once,
    none waits out its 20 s bound."""
    out = _values(run_ranks(cases.capture_errors, 4, _env(2), kind, timeout_s=240))
    for r, o in enumerate(out):
        first = (o["first"] or [None])[0]
        assert o["first_s"] < 10.0, (r, o)
        if kind == "bad_shape":     # the others return, or raise at once where rank 3 left first
            assert first == "TypeError" if r == 3 else first in (None, "EPRemoteError", "ProxyRemoteError"), (r, o)
        elif kind == "bad_ids":     # rank 3's call returns (or hears of a peer that already failed)
            assert first in (None, "EPRemoteError", "ProxyRemoteError"), (r, o)
            if r == 3:              # its own recorded error, not its peers' echo of it
                assert o["checked"][0] == "ValueError" and "topk_idx" in o["checked"][1], o
        elif r in (0, 1):      # on CPU the forwarding leg raises at the call's end; on GPU at check()
            assert "EPCapacityError" in (first, (o["checked"] or [None])[0]), (r, o)
            if kind == "capacity_rank":
                msg = o["first"][1] if o["first"] and o["first"][0] == "EPCapacityError" else o["checked"][1]
                # (rank 1 may hear it from rank 0's GONE word, which names the rank but not its value)
                assert ("num_worst_tokens=4" in msg or r == 1 and "rank 0 found more rows" in msg) and \
                    "forwarding leg of host 0: ranks [0, 1]" in msg, (r, o)
        assert o["next"] is not None and o["next_s"] < 10.0, (r, o)


@pytest.mark.parametrize("kind,want", [("capacity_net", "rank 0: 2"),
                                       ("capacity_room", "more records than the 1 its staging area took")])
def test_capture_path_stream_over_the_receivers_room_is_cut(kind, want):
    """2 hosts of one rank, many rounds: rank 0's room is too small for the 6 records rank 1 sends it (its
    num_worst_tokens is 2; or, ``capacity_room``, it is 64, but rank 1 said it has 1 token, so the staging area,
    bounded by the peers' token counts, takes 1 record), and rank 0's own rounds (its T is 1) cover only its
    room. Rank 1's stream is cut after its first round (both sides agree from the headers, so no wait is left
    over): rank 1's call returns (both ranks meet at a barrier before either checks), rank 0's check() raises
    EPCapacityError naming its room, rank 1 then hears of the failure; no rank waits out its bound, and every next
    call raises at once."""
    out = _values(run_ranks(cases.capture_errors, 2, _env(1, **_MANY_ROUNDS), kind, timeout_s=240))
    for r, o in enumerate(out):
        assert o["first_s"] < 10.0 and o["next"] is not None and o["next_s"] < 10.0, (r, o)
    seen = [x for x in (out[0]["first"], out[0]["checked"]) if x]
    assert seen and seen[0][0] == "EPCapacityError" and want in seen[0][1], out[0]
    # rank 1's call ends by itself (its stream cut, not its wait for credit ended by rank 0's failure)
    assert out[1]["first"] is None, out[1]


def test_capture_path_staging_follows_the_peers_tokens():
    """2 hosts of 2 ranks, ragged T (one 0), num_worst_tokens 64 times the largest T (DeepEP passes T * R): each
    rank's staging areas take the most tokens of itself and its RDMA peer (the rank of its local index on the other
    host), not the host's num_worst_tokens added up, and dispatch, combine and cached dispatch are the reference's
    bit for bit."""
    Ts, H, K, per_host = [3, 0, 5, 6], 64, 2, 2
    worst = 64 * max(Ts)
    out = _values(run_ranks(cases.capture_staging, 4, _env(per_host), Ts, worst, timeout_s=240))
    rec = network_record_bytes(2 * H, 0, K, True, per_host)
    for r, o in enumerate(out):
        assert o["combined"], (r, o)
        room = max(Ts[r], Ts[(r + 2) % 4])
        assert o["staging"] == 2 * (4 * NET_HEADER_WORDS + room * rec), (r, o["staging"], room, rec)
        assert o["staging"] * 64 < 2 * (per_host * worst) * rec, (r, o["staging"])    # what C records took
    assert sum(o["rows"] for o in out) > 0


def test_capture_path_dropped_signal_ends_every_wait():
    """A dropped signal on the capture path: rank 1's ring wait for the chunk runs out of time, which ends
    every later ring wait at once; both ranks raise (at the call's end on CPU, at the next check() on a GPU)
    within the bound, and their next calls at once."""
    out = _values(run_ranks(cases.failure, 2, _env(1), "dropped_signal", 3.0, 512, timeout_s=120))
    for o in out:
        assert o[0] in ("ProxyError", "ProxyRemoteError", "EPTimeoutError", "EPRemoteError"), o
        assert o[2] < 3.0 + 5.0 and o[3] is not None and o[5] < 1.0, o


@pytest.mark.parametrize("kind,world,per_host", [("combine_vs_cached", 2, 1), ("hidden", 2, 1), ("zero_worst", 2, 1),
                                                  ("sum_overflow", 4, 2)])
def test_capture_path_different_calls_fail_at_once(kind, world, per_host):
    """Ranks across hosts making different calls on the capture path (a combine against a cached dispatch of
    the same record size; rows of another width, whose longer stream both sides cut after its first round; one
    rank without num_worst_tokens, on the host path), or values whose sum a stream cannot count, raise
    ValueError at the call or the next check(), where it was found, and no rank waits out its 20 s bound."""
    out = _values(run_ranks(cases.capture_mismatch, world, _env(per_host, **_MANY_ROUNDS), kind, timeout_s=240))
    for r, o in enumerate(out):
        assert o["s"] < 10.0, (r, o)
        seen = [x for x in (o["first"], o["checked"]) if x]
        assert seen, (r, o)
    found = [x for o in out for x in (o["first"], o["checked"]) if x and x[0] == "ValueError"]
    assert found, out
    if kind == "sum_overflow":      # found before anything is sent (a rank may hear of a peer's failure first)
        assert all(o["first"] for o in out), out
        assert any(o["first"][0] == "ValueError" and "add up to 4294967294" in o["first"][1] for o in out), out
    if kind == "zero_worst":        # the rank without num_worst_tokens reads the other's stream as a header
        assert out[0]["first"][0] == "ValueError" and "different calls" in out[0]["first"][1], out
    if kind in ("combine_vs_cached", "hidden"):     # both ranks read the other's header (another layout), and name
        want = {"combine_vs_cached": "the operation: rank 0 called combine, rank 1 called cached dispatch",
                "hidden": "dispatch with num_worst_tokens: hidden: rank 0 passed 64, rank 1 passed 256"}[kind]
        assert all(any(x and x[0] == "ValueError" and want in x[1] for x in (o["first"], o["checked"]))
                   for o in out), out       # (from the two ranks' call cards, exchanged in the group's store)


@pytest.mark.parametrize("kind,want", [
    # rank 3's x is narrower: rank 1 (its RDMA peer) and rank 3 find other record layouts in their streams' headers,
    # rank 2 and rank 3 in host 1's forwarding leg; ranks 0 and 2 only see the network leg end
    ("dispatch_hidden", ("dispatch with num_worst_tokens: hidden: rank ", " passed 64, rank 3 passed 32")),
    # rank 3 combines narrower rows: host 1's forwarding leg finds it, the other host sees the leg end
    ("combine_hidden", ("combine: hidden: rank 2 passed 64, rank 3 passed 32",)),
])
def test_capture_path_disagreement_is_a_value_error_on_every_rank(kind, want):
    """2 hosts of 2 ranks on the capture path; rank 3's call differs (its hidden size). Every rank raises ValueError
    naming the field and both values with global rank numbers, at the call or at a check() after it (before:
    ValueError on the two RDMA peers, "another layout", and EPRemoteError / ProxyRemoteError on the others): the
    failing ranks post their call cards in the group's store and the one that found the disagreement tells it there
    before the failure reaches anyone. As any capture-path failure, it ends the network leg: the next call raises at
    once; a new Buffer's num_worst_tokens dispatch and combine are correct."""
    out = _values(run_ranks(cases.capture_disagreement, 4, _env(2), kind, timeout_s=240))
    for r, (first, nxt, nxt_s, fresh) in enumerate(out):
        assert first is not None and first[0] == "ValueError" and all(w in first[1] for w in want), (r, first)
        assert nxt is not None and nxt_s < 5.0, (r, out)
        assert fresh is True, (r, out)


def test_capture_path_after_a_rejected_host_path_call():
    """A num_worst_tokens dispatch on the host path that rank 3 rejects, then the capture path (as while a
    CUDA graph is captured): the host's ranks re-synchronise before exchanging their num_worst_tokens, so the
    dispatch, combine and cached dispatch that follow are the reference's bit for bit on every rank."""
    out = _values(run_ranks(cases.worst_after_rejection, 4, _env(2, TRITON_EP_INTERNODE_CAPTURE_PATH="0"),
                            timeout_s=240))
    assert out[3]["first"] == "TypeError", out
    assert all(o["first"] is not None for o in out), out
    assert all(o["checked"]["combined"] for o in out), out


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_capture_path_peak_memory_of_a_num_worst_tokens_round_trip(fp8):
    """2 hosts of 2 ranks, T 64, hidden 256, top-4 of 16 experts, num_worst_tokens = T * R (as DeepEP's tests pass):
    each call's peak live bytes (:class:`triton_ep.testing.LiveBytes`, with a GPU's caching allocator the memory a
    call costs) stay within what its design needs, so a regression that keeps one more copy alive shows.

    - dispatch (bf16, and FP8 pairs): the forwarding leg's intranode dispatch writes ``W = num_worst_tokens`` rows
      (each the record's 16-byte meta block and the row; the scales, ids and weights beside) in its own order, which
      are gathered in DeepEP's order into the results: both live at once, 2 x the results' bytes, plus per row 16
      meta bytes and under 112 bytes of index work (meta as int32, the sort's keys and order, the source index).
      The staging areas and the records' fields are freed before that (kept alive until the gather, they made the
      peak 3.2 x the results here).
    - cached dispatch: the same without ids and weights (16 meta bytes and under 64 of index work a row).
    - combine: its rows put in the intranode dispatch's order (``in`` bytes), and the intranode combine's bf16 sums
      and fp32 sums over rounds of the ``F = num_hosts * T`` rows this rank forwarded, 6 bytes a value; the
      staging areas come after those are freed, one host's sums in fp32 at a time."""
    T, H, E, K, world, per_host = 64, 256, 16, 4, 4, 2
    W, F = T * world, 2 * T
    out = _values(run_ranks(cases.transient_bytes, world, _env(per_host), T, H, E, K, W, fp8, timeout_s=300))
    for r, o in enumerate(out):
        d, c = o["dispatch"], o["cached"]
        assert d["peak"] <= 2 * d["out"] + 128 * W, (r, d)
        assert c["peak"] <= 2 * c["out"] + 80 * W, (r, c)
        assert d["cyclic"] == 0 and c["cyclic"] == 0, (r, o)      # (nothing left in reference cycles)
        if not fp8:
            m = o["combine"]
            assert m["peak"] <= m["in"] + 6 * F * H + 64 * W, (r, m)
            assert m["cyclic"] == 0, (r, m)
