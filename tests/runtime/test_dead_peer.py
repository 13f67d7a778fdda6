"""A rank whose process dies in the middle of a call (SIGKILL) is seen by the ranks of its host in about a second,
not at ``timeout_s``: every survivor raises ``EPRemoteError`` naming the dead rank and the stage it waited at, in
normal mode (count exchange, send/receive, the host's wait for num_worst_tokens, combine) and low-latency mode. A
peer that lives but does not answer still gets ``EPTimeoutError`` at ``timeout_s``; one that destroyed its Buffer
while its peers still call is named at once (``EPRemoteError``: "rank N destroyed its Buffer"), and ranks that destroy
at different times after their last call raise nothing. Nothing is left in /dev/shm
(the autouse fixture). The rank bodies are in tests/cases/dead_peer.py."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.cases import dead_peer as cases
from triton_ep.testing import RankFailure, run_ranks

#: the survivors' bound: the time a live peer may take to answer
TIMEOUT_S = 60.0
#: what the tests accept from kill to error: well under TIMEOUT_S (about 0.1-0.5 s here), loose for a loaded CI
BOUND_S = 15.0
#: what each mode's error names as the stage
STAGES = {"notify": "dispatch/notify counts", "dispatch": "dispatch/receive", "worst": "dispatch/num_worst_tokens",
          "combine": "combine/", "ll_dispatch": "low_latency_dispatch/", "ll_combine": "low_latency_combine/",
          "cached": "dispatch/"}


def _check_survivors(out, mode, victim=1):
    assert isinstance(out[victim], RankFailure) and "ProcessDied" in str(out[victim]), out[victim]
    for r, o in enumerate(out):
        if r == victim:
            continue
        assert not isinstance(o, RankFailure), (r, o)
        kind, msg, dt, kind2, dt2 = o[:5]
        assert kind == "EPRemoteError", (r, kind, msg)
        assert f"rank {r}: rank {victim}'s process is gone" in msg and STAGES[mode] in msg, (r, msg)
        assert dt < BOUND_S, (r, dt)
        assert kind2 == "EPError" and dt2 < 1.0, (r, kind2, dt2)     # the Buffer is unusable: at once


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", cases.MODES)
def test_a_killed_peer_is_a_remote_error_within_seconds(mode):
    """3 ranks; rank 1 dies (SIGKILL) at the point ``mode`` names (tests/cases/dead_peer.MODES): ranks 0 and 2 raise
    EPRemoteError naming rank 1 and their stage well within timeout_s (60 s), also the one whose wait was for a
    live peer that gave up on the dead one; their next call raises EPError at once."""
    _check_survivors(run_ranks(cases.killed_mid_call, 3, mode, TIMEOUT_S, 1, timeout_s=240), mode)


@pytest.mark.multiprocess
def test_a_killed_peer_is_masked_with_enable_shrink():
    """With enable_shrink a low-latency dispatch masks the dead rank (as a timed-out one) well within timeout_s, and
    goes on without it; the next call too."""
    out = run_ranks(cases.killed_mid_call, 3, "ll_shrink", TIMEOUT_S, 1, timeout_s=240)
    assert isinstance(out[1], RankFailure) and "ProcessDied" in str(out[1]), out[1]
    for r in (0, 2):
        kind, mask, dt, kind2, dt2 = out[r][:5]
        assert (kind, mask, kind2) == ("no error", "[0, 1, 0]", "no error"), out[r]
        assert dt < BOUND_S and dt2 < BOUND_S, out[r]


@pytest.mark.multiprocess
def test_a_live_silent_peer_still_times_out():
    """A peer that lives but never calls, holding its Buffer, gives EPTimeoutError at timeout_s naming it, as
    before."""
    out = run_ranks(cases.silent_peer, 2, "stuck", 2.0, timeout_s=120)
    kind, msg, dt = out[0]
    assert kind == "EPTimeoutError" and "peer 1" in msg, (kind, msg)
    assert 2.0 <= dt < 2.0 + BOUND_S, dt
    assert out[1] is None, out[1]


#: the survivors' bound where a peer destroyed its Buffer: small, so that an error at timeout_s fails the test
DESTROYED_TIMEOUT_S = 10.0


def _check_destroyed(out, mode, victim=1):
    assert out[victim] is None, out[victim]
    for r, o in enumerate(out):
        if r == victim:
            continue
        assert not isinstance(o, RankFailure), (r, o)
        kind, msg, dt, kind2, dt2 = o[:5]
        assert kind == "EPRemoteError", (r, kind, msg, dt)
        assert f"rank {r}: rank {victim} destroyed its Buffer (destroy())" in msg and STAGES[mode] in msg, (r, msg)
        assert dt < DESTROYED_TIMEOUT_S / 2, (r, dt)
        assert kind2 == "EPError" and dt2 < 1.0, (r, kind2, dt2)     # the Buffer is unusable: at once


@pytest.mark.multiprocess
def test_a_peer_destroyed_before_the_call_is_named_at_once():
    """A peer that lives on but destroyed its Buffer (its lock released on purpose: no death) before a dispatch its peer
    makes: that peer raises EPRemoteError naming it as having destroyed its Buffer, well within timeout_s (before:
    EPTimeoutError at timeout_s)."""
    out = run_ranks(cases.silent_peer, 2, "destroyed", DESTROYED_TIMEOUT_S, timeout_s=120)
    kind, msg, dt = out[0]
    assert kind == "EPRemoteError" and "rank 0: rank 1 destroyed its Buffer (destroy())" in msg \
        and STAGES["notify"] in msg, (kind, msg, dt)
    assert dt < DESTROYED_TIMEOUT_S / 2, dt
    assert out[1] is None, out[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", cases.DESTROYED_MODES)
def test_a_peer_destroyed_mid_call_is_named_within_seconds(mode):
    """3 ranks; rank 1 destroys its Buffer (its process lives on) while ranks 0 and 2 make the call ``mode`` names
    (tests/cases/dead_peer.DESTROYED_MODES: a dispatch, a cached dispatch, a dispatch with num_worst_tokens, a combine,
    a low-latency dispatch or combine within one host): both raise EPRemoteError naming rank 1 as having destroyed its
    Buffer and their stage well within timeout_s (10 s), also the one whose wait was for the live peer that gave up on
    it; their next call raises EPError at once (before: EPTimeoutError naming rank 1 at timeout_s)."""
    _check_destroyed(run_ranks(cases.destroyed_mid_call, 3, mode, DESTROYED_TIMEOUT_S, 1, timeout_s=240), mode)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ll", [False, True], ids=["dispatch", "ll_dispatch"])
def test_a_peer_that_raised_then_dropped_its_buffer_is_named_as_failed(ll):
    """3 ranks; rank 1 passes an int16 topk_idx, catches the TypeError and drops its Buffer without destroy() (as an
    uncaught error does at its process's exit) while ranks 0 and 2 make the dispatch: they raise EPRemoteError
    naming rank 1 as having failed the call, well within timeout_s, not as having destroyed its Buffer cleanly
    (before: a dropped Buffer's liveness byte always said "closed", and peers that looked after it was released
    named a clean destroy())."""
    out = run_ranks(cases.rejected_then_dropped, 3, ll, DESTROYED_TIMEOUT_S, 1, timeout_s=240)
    assert out[1][0] == "TypeError" and "topk_idx" in out[1][1], out[1]
    for r in (0, 2):
        kind, msg, dt = out[r]
        assert kind == "EPRemoteError" and "rank 1 failed the call" in msg and "destroyed" not in msg, (r, kind, msg)
        assert dt < DESTROYED_TIMEOUT_S / 2, (r, dt)


@pytest.mark.multiprocess
def test_a_destroyed_peer_is_masked_with_enable_shrink():
    """With enable_shrink a low-latency dispatch masks a rank that destroyed its Buffer (as a dead one) well within
    timeout_s, and goes on without it; the next call too (before: masked after timeout_s, 10 s)."""
    out = run_ranks(cases.destroyed_mid_call, 3, "ll_shrink", DESTROYED_TIMEOUT_S, 1, timeout_s=240)
    assert out[1] is None, out[1]
    for r in (0, 2):
        kind, mask, dt, kind2, dt2 = out[r][:5]
        assert (kind, mask, kind2) == ("no error", "[0, 1, 0]", "no error"), out[r]
        assert dt < DESTROYED_TIMEOUT_S / 2 and dt2 < DESTROYED_TIMEOUT_S / 2, out[r]


@pytest.mark.multiprocess
@pytest.mark.parametrize("ll", [False, True], ids=["normal", "low_latency"])
def test_ranks_destroying_at_different_times_at_the_end_raise_nothing(ll):
    """3 ranks make correct calls and destroy their Buffers one after another (rank 0 at once, rank 2 1.5 s later), as
    a program's ranks end; in low-latency mode rank 0 calls its last receive hooks at once and destroys, while the
    others call their last one once they saw rank 0 closed (its DEAD word set: their waits were met before it left).
    No rank raises anything: a peer that destroyed its Buffer ends only the waits it still leaves short."""
    from triton_ep.transport.signals import LEFT_WORDS
    out = run_ranks(cases.destroyed_at_the_end, 3, ll, 1.5, timeout_s=240)
    closed = LEFT_WORDS["closed"] if ll else None
    assert out == [([], None), ([], closed), ([], closed)], out


def test_the_dead_peer_look_compiles_for_the_gpu(tmp_path):
    """The GPU wait (``%globaltimer``) reads the host's DEAD word every DEAD_LOOK looks: its compiled form (loop-carried
    spin count, the nested look, the flag's bursts), and a low-latency wait's with its failure word and error post,
    build to a cubin, which the interpreter would not check."""
    code = textwrap.dedent('''
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton_ep.kernels import flags as F

        @triton.jit
        def waits(flag, hdr, hdr_delta, host, want, me, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr):
            for r in tl.static_range(R):
                if r != me:
                    st = F.wait_at_least(flag + r, want, hdr, host, r, want, timeout_ns, R, USE_CLOCK)
                    if st != 0:
                        F.post_wait_error(hdr, hdr_delta, host, st, r, 1, want, me, R)

        names = list(waits.arg_names)
        sig = dict(flag="*i64", hdr="*i64", hdr_delta="*i64", host="*i64", want="i64", me="i32", timeout_ns="i64",
                   R="constexpr", USE_CLOCK="constexpr")
        k = triton.compile(ASTSource(fn=waits, signature=sig, constexprs={(names.index("R"),): 4,
                                                                          (names.index("USE_CLOCK"),): True}),
                           target=GPUTarget("cuda", 90, 32))
        assert "cubin" in k.asm and "globaltimer" in k.asm["ptx"], list(k.asm)

        @triton.jit
        def ll_waits(flag, hdr, hdr_delta, host, ctl, want, me, timeout_ns, R: tl.constexpr, USE_CLOCK: tl.constexpr):
            for r in tl.static_range(R):
                if r != me:
                    st = F.wait_at_least(flag + r, want, hdr, host, r, 0, timeout_ns, R, USE_CLOCK,
                                         ctl + F.off_ll_failed(R) + r, want)
                    if st != 0:
                        F.post_wait_error(hdr, hdr_delta, host, st, r, 1, want, me, R, ctl, want)

        names = list(ll_waits.arg_names)
        sig = dict(flag="*i64", hdr="*i64", hdr_delta="*i64", host="*i64", ctl="*i64", want="i64", me="i32",
                   timeout_ns="i64", R="constexpr", USE_CLOCK="constexpr")
        k = triton.compile(ASTSource(fn=ll_waits, signature=sig, constexprs={(names.index("R"),): 4,
                                                                             (names.index("USE_CLOCK"),): True}),
                           target=GPUTarget("cuda", 90, 32))
        assert "cubin" in k.asm, list(k.asm)
        print("ok")
    ''')
    script = tmp_path / "compile_waits.py"        # (a jit function needs a source file)
    script.write_text(code)
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode and ("ptxas" in r.stderr or "No module named 'triton.backends.nvidia'" in r.stderr):
        pytest.skip(f"Triton's CUDA backend cannot compile here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["dispatch", "combine", "ll_dispatch", "ll_combine"])
def test_gpu_a_killed_peer_is_a_remote_error_within_seconds(mode):
    """The GPU twin: compiled kernels spinning on the GPU clock end their wait for the dead rank when the host's
    watcher sets its DEAD word (read every DEAD_LOOK looks); 2 ranks per GPU (shared where there is one)."""
    import torch
    world = 3 if torch.cuda.device_count() >= 3 else 2
    out = run_ranks(cases.killed_mid_call, world, mode, TIMEOUT_S, 1, "cuda", timeout_s=300)
    _check_survivors(out, mode)


def test_bench_dead_peer_refuses_bad_arguments(tmp_path, capsys):
    """benchmarks/bench_dead_peer.py checks its arguments before it starts any rank (argparse errors, exit 2)."""
    bench_dir = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        import bench_dead_peer as bench
    finally:
        sys.path.remove(bench_dir)
    (tmp_path / "file").write_text("")
    for argv, says in ((["--ranks", "1"], "--ranks"), (["--modes", "dispatch,nope"], "nope"),
                       (["--timeout-s", "0"], "--timeout-s"), (["--out", str(tmp_path / "file")], "--out"),
                       (["--host-modes", "internode,nope"], "nope"), (["--host-ranks", "3"], "--host-ranks"),
                       (["--host-ranks", "2,x"], "--host-ranks"), (["--host-ranks", "2,6,0"], "--host-ranks"),
                       (["--proxies", "fork"], "--proxies")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
    a = bench.parse_args(["--modes", "combine,ll_dispatch"])
    assert a.modes == ["combine", "ll_dispatch"] and a.out is None
    a = bench.parse_args(["--modes", "", "--host-modes", "internode_ll", "--proxies", "process"])
    assert (a.modes, a.host_modes, a.proxies, a.host_ranks) == ([], ["internode_ll"], ["process"], [2, 4])
    assert bench.parse_args(["--host-ranks", "4"]).host_ranks == [4]


def _signals_with_record(kind, peer, stage, left):
    """Rank 0's Signals of a group of 3 (CPU, no process) holding the record ``(kind, peer, stage)`` and the ``DEAD``
    words ``left`` (``{peer: how}``) as the liveness watcher sets them."""
    from triton_ep.protocol import signal_header as F
    from triton_ep.transport.signals import Signals
    R = 3
    hdr = [torch.zeros(F.header_words.host(R), dtype=torch.int64) for _ in range(R)]
    sig = Signals(0, R, hdr[0], hdr, torch.zeros(R, dtype=torch.int64), torch.device("cpu"), 10.0, interpreted=True)
    mark = sig.dead_marker()
    for p, how in left.items():
        mark(p, how)
    h = sig.host.numpy()
    h[int(F.H_PEER)], h[int(F.H_STAGE)], h[int(F.H_CALL)], h[int(F.H_KIND)] = peer, int(stage), 4, int(kind)
    return sig


def test_whom_a_record_names_where_peers_destroyed_their_buffers():
    """The naming rules (docs/design.md, Destroyed peers), on rank 0 of 3 (host side only): a wait for a rank that
    closed cleanly, or after an error that did not end that wait, names it as having destroyed its Buffer; a live (or
    broken) peer's failure names the rank that closed cleanly; a rank that raised an error and closed is not taken for
    the cause of a live peer's failure (before: no rule, a closed rank was waited for until timeout_s); a dead rank
    comes first; a live peer's timeout, a peer that timed out and left, and num_worst_tokens overflow stay as they
    were."""
    from triton_ep.protocol import signal_header as F
    from triton_ep.transport.liveness import CLOSED, CLOSED_BROKEN, CLOSED_FAILED, DEAD
    recv, gone, failed, timeout = F.STAGE_DISPATCH_RECV, F.E_GONE, F.E_FAILED, F.E_TIMEOUT
    destroyed = "rank 0: rank {} destroyed its Buffer (destroy()) while this rank waited at stage 'dispatch/receive"
    for kind, peer, stage, left, cls, says, failed_rank in (
            (gone, 1, recv, {1: CLOSED}, "EPRemoteError", destroyed.format(1), 1),
            (gone, 1, recv, {1: CLOSED_FAILED}, "EPRemoteError", destroyed.format(1), 1),
            (timeout, 1, recv, {1: CLOSED}, "EPRemoteError", destroyed.format(1), 1),
            (failed, 2, recv, {1: CLOSED}, "EPRemoteError", destroyed.format(1), 1),
            (failed, 2, recv, {1: CLOSED, 2: CLOSED_BROKEN}, "EPRemoteError", destroyed.format(1), 1),
            (failed, 2, recv, {1: CLOSED_FAILED}, "EPRemoteError", "rank 2 failed the call", 2),
            (failed, 1, recv, {1: CLOSED_FAILED}, "EPRemoteError", "rank 1 failed the call", 1),
            (gone, 1, F.STAGE_DISPATCH_SEND, {1: CLOSED_BROKEN}, "EPRemoteError",
             "rank 1 timed out at stage 'dispatch/send' and left the group", None),
            (gone, 1, F.STAGE_CAPACITY, {1: CLOSED_FAILED}, "EPCapacityError", "num_worst_tokens", None),
            (timeout, 2, recv, {1: CLOSED}, "EPTimeoutError", "waited 10 s for peer 2", None),
            (gone, 1, recv, {1: CLOSED, 2: DEAD}, "EPRemoteError", "rank 2's process is gone", 2)):
        ex = _signals_with_record(kind, peer, stage, left).error()
        assert type(ex).__name__ == cls and says in str(ex), (kind, peer, stage, left, ex)
        assert getattr(ex, "failed_rank", None) == failed_rank, (kind, peer, left, ex)


def test_liveness_tells_a_closed_peer_from_a_dead_one(tmp_path):
    """Three ranks' liveness locks in one file (each its own open file description): rank 1 closes after an error,
    rank 2's descriptor goes without a word (as a dead process's). Rank 0 takes only rank 2 for dead; with
    ``closes_leave`` rank 1 has left too, and the watcher reports it once through ``on_closed`` with how it closed."""
    import threading
    from triton_ep.transport import liveness as live
    if not live.supported():
        pytest.skip("no open-file-description locks here")
    path = str(tmp_path / "live")
    ranks = [live.Liveness(path, 0, 3, create=True)] + [live.Liveness(path, r, 3, create=False) for r in (1, 2)]
    try:
        assert ranks[0].left_peers() == {} and ranks[0].dead_peers() == {}
        ranks[1].close(how=live.CLOSED_FAILED)
        ranks[2].close(orderly=False)
        assert ranks[0].dead_peers() == {2: live.DEAD} and ranks[0].left_peers() == {2: live.DEAD}
        ranks[0].closes_leave = True
        assert ranks[0].left_peers() == {1: live.CLOSED_FAILED, 2: live.DEAD}
        seen, done = [], threading.Event()
        ranks[0].watch(lambda p: seen.append((p, live.DEAD)), 0.01,
                       on_closed=lambda p, how: (seen.append((p, how)), done.set()))
        assert done.wait(5.0)
        time.sleep(0.05)        # (a few more looks: each peer is told once)
        assert sorted(seen) == [(1, live.CLOSED_FAILED), (2, live.DEAD)], seen
    finally:
        for r in ranks:
            r.close()
