"""A rank whose process dies in the middle of a call (SIGKILL) is seen by the ranks of its host in about a second,
not at ``timeout_s``: every survivor raises ``EPRemoteError`` naming the dead rank and the stage it waited at, in
normal mode (count exchange, send/receive, the host's wait for num_worst_tokens, combine) and low-latency mode. A
peer that lives but does not answer still gets ``EPTimeoutError`` at ``timeout_s``. Nothing is left in /dev/shm
(the autouse fixture). The rank bodies are in tests/cases/dead_peer.py."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.cases import dead_peer as cases
from triton_ep.testing import RankFailure, run_ranks

#: the survivors' bound: the time a live peer may take to answer
TIMEOUT_S = 60.0
#: what the tests accept from kill to error: well under TIMEOUT_S (about 0.1-0.5 s here), loose for a loaded CI
BOUND_S = 15.0
#: what each mode's error names as the stage
STAGES = {"notify": "dispatch/notify counts", "dispatch": "dispatch/receive", "worst": "dispatch/num_worst_tokens",
          "combine": "combine/", "ll_dispatch": "low_latency_dispatch/", "ll_combine": "low_latency_combine/"}


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
@pytest.mark.parametrize("how", ["stuck", "destroyed"])
def test_a_live_silent_peer_still_times_out(how):
    """A peer that lives but never calls (holding its Buffer, or having destroyed it: its lock released on purpose
    is no death) gives EPTimeoutError at timeout_s naming it, as before."""
    out = run_ranks(cases.silent_peer, 2, how, 2.0, timeout_s=120)
    kind, msg, dt = out[0]
    assert kind == "EPTimeoutError" and "peer 1" in msg, (kind, msg)
    assert 2.0 <= dt < 2.0 + BOUND_S, dt
    assert out[1] is None, out[1]


def test_the_dead_peer_look_compiles_for_the_gpu(tmp_path):
    """The GPU wait (``%globaltimer``) reads the host's DEAD word every DEAD_LOOK spins: its compiled form (loop-carried
    spin count, the nested look) builds to a cubin, which the interpreter would not check."""
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
    watcher sets its DEAD word (read every DEAD_LOOK spins); 2 ranks per GPU (shared where there is one)."""
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
