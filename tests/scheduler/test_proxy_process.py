"""The RDMA proxy in a process of its own (triton_ep/proxy_process/, ``TRITON_EP_PROXY=process``): bit-exact
round trips, what its entry imports, and its lifetime on every path (closed and reaped; killed, or stopped: ProxyError
at the rank within 2 s; the rank killed: the proxy ends within about 1 s; a forked child of the rank cannot close it;
/dev/shm too small: a clear error before anything starts). The fixture's leak check covers /dev/shm, threads,
descriptors and processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.cases.sched_helpers import ProcGroup, fabric, in_threads
from triton_ep.proxy_process import ENV_PROXY, ProcessScheduler, proxy_kind
from triton_ep.scheduler import ProxyError, host_alltoall
from triton_ep.transport import shm
from triton_ep.transport.signals import RingFlags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _alltoall(g, sizes):
    data = [np.random.default_rng(r).integers(0, 256, sizes[r], dtype=np.uint8) for r in range(2)]
    res = in_threads(lambda r: host_alltoall(g.scheds[r], {1 - r: data[r]}, {1 - r: sizes[1 - r]}), 2)
    for x in res:
        if isinstance(x, BaseException):
            raise x
    return data, res


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True         # (ended; its parent reaps it)
        except OSError:
            return True
        time.sleep(0.02)
    return False


def test_round_trip_bit_exact_and_closed():
    """Both directions over the emulated fabric, chunks split across slots and QPs, the bytes as sent; close()
    ends and reaps both proxy processes."""
    with ProcGroup(fabric(2), 2, slots=4, slot_bytes=4096) as g:
        data, res = _alltoall(g, [50_000, 12_345])
        assert np.array_equal(res[0][1], data[1]) and np.array_equal(res[1][0], data[0])
        st = g.scheds[0].stats()
        assert st["wrs"] >= 13 and st["proxy_process_cpu_s"] >= 0
        procs = [s.proc for s in g.scheds]
    assert [p.returncode for p in procs] == [0, 0]


def test_doorbell_ends_an_idle_naps_and_restarts_the_back_off():
    """ProxySweeps' idle wait: without the doorbell rung a deep nap ends on its time (False: the idle count goes
    on); rung (as ProcessScheduler.check and publish ring it), the nap ends at once and the count restarts (True),
    and the ring is consumed (the next nap is a nap again). The rank's bell closes with the scheduler."""
    from types import SimpleNamespace

    from triton_ep.proxy_process.proxy_side import IDLE_DEEP_AFTER, IDLE_DEEP_S, ProxySweeps
    bell = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        sweeps = SimpleNamespace(bell=bell)
        t0 = time.monotonic()
        assert ProxySweeps._idle_wait(sweeps, IDLE_DEEP_AFTER + 1) is False
        assert time.monotonic() - t0 >= IDLE_DEEP_S * 0.9
        os.eventfd_write(bell, 1)
        assert ProxySweeps._idle_wait(sweeps, IDLE_DEEP_AFTER + 1) is True
        assert ProxySweeps._idle_wait(sweeps, IDLE_DEEP_AFTER + 1) is False
    finally:
        os.close(bell)
    with ProcGroup(fabric(2), 2, slots=4, slot_bytes=4096) as g:
        s0 = g.scheds[0]
        s0.check()          # (rings it: nothing to raise)
        data, res = _alltoall(g, [5000, 300])
        assert np.array_equal(res[0][1], data[1]) and np.array_equal(res[1][0], data[0])
        assert s0._bell is not None and os.fstat(s0._bell)
    assert s0._bell is None     # (closed with the scheduler)
    s0.ring()                   # (a no-op then)


def test_entry_imports_neither_torch_nor_triton():
    with ProcGroup(fabric(2), 2, slots=2, slot_bytes=4096) as g:
        mods, real = g.scheds[0]._request("modules")
    assert real == {"torch": False, "triton": False}
    assert "triton_ep.scheduler" in mods and "triton_ep.buffer" not in mods and "triton_ep.kernels" not in mods


def test_proxy_killed_is_a_proxy_error_within_2_s():
    """SIGKILL of one proxy process: that rank's check() raises ProxyError naming the rank and the process
    within 2 s, its ring waits end (abort word); close() still reaps."""
    with ProcGroup(fabric(2), 2, slots=2, slot_bytes=4096) as g:
        s = g.scheds[1]
        os.kill(s.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while s.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ProxyError, match=r"rank 1 failed at stage 'rdma proxy/process'.*killed by signal 9") as ei:
            s.check()
        assert ei.value.rank == 1 and s.flags.aborted == 2
        with pytest.raises(ProxyError):
            s.wait_counter(RingFlags.TAIL, 0, 1, "test: a wait after the proxy died")


def test_proxy_stopped_is_a_proxy_error_naming_it_within_2_s():
    """SIGSTOP of one proxy process (it lives, its sweeps do not run): within 2 s that rank's check() raises a
    ProxyError naming its own proxy process (pid, "stopped by a signal", state T) instead of a peer, its ring waits end
    (abort word), a command to it raises at once; close() kills it at once (it would not answer the close) and
    reaps it. The other rank's proxy runs on (its heartbeat moves: no error there). Before: nothing at that rank
    until its waits ran out at timeout_s, naming the peer."""
    with ProcGroup(fabric(2), 2, slots=2, slot_bytes=4096) as g:
        s, other = g.scheds[1], g.scheds[0]
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while s.error is None and time.monotonic() - t0 < 2.0:
                time.sleep(0.01)
            with pytest.raises(ProxyError, match=rf"rank 1 failed at stage 'rdma proxy/process' \(no peer\): the RDMA "
                               rf"proxy process \(pid {s.proc.pid}\) stopped making progress: stopped by a signal such "
                               rf"as SIGSTOP \(state T\)") as ei:
                s.check()
            assert ei.value.rank == 1 and s.flags.aborted == 2 and time.monotonic() - t0 < 2.0
            with pytest.raises(ProxyError, match="stopped making progress"):
                s.wait_counter(RingFlags.TAIL, 0, 1, "test: a wait after the proxy stopped")
            with pytest.raises(ProxyError, match="stopped making progress"):
                s.stats()
            other.check()
            t1 = time.monotonic()
            s.close()
            assert time.monotonic() - t1 < 2.0 and s.proc.returncode == -signal.SIGKILL
        finally:
            if s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)


def test_heartbeat_rules():
    """:class:`Heartbeat`: a word that moves, or no sweep yet, is no stall; one that stood still past ``stop_s``
    is a stall only where the process is stopped (state T); in any other state only past ``starve_s`` (half
    timeout_s, at least 5 s: a live proxy's heartbeat stood still for up to 1.2 s on a loaded 2-core machine)."""
    from triton_ep.proxy_process.heartbeat import Heartbeat, proc_state
    hb = Heartbeat(20.0)
    assert (hb.stop_s, hb.starve_s) == (1.0, 10.0) and Heartbeat(2.0).stop_s == 0.5 and Heartbeat(2.0).starve_s == 5.0
    me = os.getpid()
    assert hb.stalled(0, 0.0, me) is None and hb.stalled(0, 100.0, me) is None      # (no sweep yet)
    assert hb.stalled(7, 100.0, me) is None and hb.stalled(7, 101.5, me) is None    # (running: below starve_s)
    assert "it lives (state R) but is starved" in hb.stalled(7, 110.5, me)
    assert hb.stalled(8, 111.0, me) is None and hb.still_s(111.0) == 0.0            # (it moved)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while proc_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hb.stalled(8, 111.9, child.pid) is None                               # (below stop_s)
        assert hb.stalled(8, 112.1, child.pid) == "stopped by a signal such as SIGSTOP (state T)"
    finally:
        child.kill()
        child.wait()
    assert proc_state(child.pid) is None and hb.stalled(8, 130.0, child.pid) is None    # (gone: the channel tells)


def test_proxy_failure_travels_with_peer_qp_and_stage():
    """A chunk with a bad length: the proxy's own ProxyError (rank, peer, channel, QP, stage) at the rank."""
    with ProcGroup(fabric(2), 2, slots=2, slot_bytes=4096) as g:
        s = g.scheds[0]
        s.flags.set_len(1, 0, 0)
        s.flags.put(RingFlags.READY, 1, 1)
        deadline = time.monotonic() + 5.0
        while s.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ProxyError, match="rank 0 failed at stage 'rdma proxy/post' \\(peer 1, channel"):
            s.check()
        assert s.error.peer == 1 and s.error.qp is not None


def test_forked_child_does_not_close_the_proxy():
    with ProcGroup(fabric(2), 2, slots=2, slot_bytes=4096) as g:
        pid = os.fork()
        if pid == 0:            # the child inherited the schedulers: closing them there touches nothing
            try:
                g.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert all(s.proc.poll() is None for s in g.scheds)
        data, res = _alltoall(g, [9000, 9000])
        assert np.array_equal(res[1][0], data[0])


RANK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.cases.sched_helpers import fabric
    from triton_ep.proxy_process import ProcessScheduler
    ps = ProcessScheduler("emulated", 0, 2, dict(fabric=fabric(2), device_name="mlx5_0", num_qps_per_peer=2,
                                               timeout_s=10.0), slots=2, slot_bytes=4096, timeout_s=10.0)
    print(ps.proc.pid, flush=True)
    time.sleep(60)
""")


def test_rank_killed_ends_the_proxy_within_a_second():
    """The rank's process SIGKILLed (a forked child of it still holding the channel's end open is not needed:
    the proxy watches its parent, not the channel): the proxy process is gone within about a second."""
    rank = subprocess.Popen([sys.executable, "-c", RANK.format(root=str(ROOT))],
                            stdout=subprocess.PIPE, text=True)
    try:
        proxy = int(rank.stdout.readline())
        t0 = time.monotonic()
        rank.kill()
        rank.wait()
        assert _gone(proxy, 3.0), "the proxy outlived its rank by 3 s"
        took = time.monotonic() - t0
        assert took < 3.0
    finally:
        rank.kill()
        rank.wait()
        rank.stdout.close()


def test_small_dev_shm_is_a_clear_error_before_any_process(monkeypatch):
    st = os.statvfs(shm.shm_dir())
    too_big = st.f_blocks * st.f_frsize + (1 << 30)
    slot = 1 << 30
    with pytest.raises(OSError, match=r"cannot reserve \d+ bytes .*--shm-size.*--ipc=host"):
        ProcessScheduler("emulated", 0, 2, dict(fabric=fabric(2), device_name="mlx5_0", num_qps_per_peer=2,
                                                timeout_s=5.0), slots=max(1, too_big // (4 * slot) + 1),
                         slot_bytes=slot, timeout_s=5.0)


def test_proxy_kind_values(monkeypatch):
    monkeypatch.delenv(ENV_PROXY, raising=False)
    assert proxy_kind() == ("process" if sys.platform.startswith("linux") else "thread")
    monkeypatch.setenv(ENV_PROXY, " ")
    assert proxy_kind() == ("process" if sys.platform.startswith("linux") else "thread")
    monkeypatch.setenv(ENV_PROXY, "Thread")
    assert proxy_kind() == "thread"
    monkeypatch.setenv(ENV_PROXY, "Process")
    assert proxy_kind() == "process"
    monkeypatch.setenv(ENV_PROXY, "fork")
    with pytest.raises(ValueError, match="TRITON_EP_PROXY='fork'"):
        proxy_kind()


@pytest.mark.gpu
def test_gpu_kernel_writes_the_shared_rings():
    """On a GPU the rank registers the rings' mapping with cudaHostRegister (device-mapped): a Triton kernel
    stores into them through their pointer, the host (and the proxy process) read the words; close()
    unregisters."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(ptr + o, o + 7, mask=o < n)

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fab = fabric(2)
    s = ProcessScheduler("emulated", 0, 2, dict(fabric=fab, device_name="mlx5_0", num_qps_per_peer=2,
                                                timeout_s=10.0), slots=2, slot_bytes=4096, timeout_s=10.0,
                         device=torch.device("cuda", 0))
    try:
        ring = torch.from_numpy(s.mem[s.layout.ctrl_bytes:s.layout.ctrl_bytes + 4096]).view(torch.int32)
        ring.fill_(-1)
        _fill[(1,)](ring, 1024, BLOCK=1024)
        torch.cuda.synchronize()
        assert ring.tolist() == list(range(7, 7 + 1024))
    finally:
        s.close()
