"""Rank bodies of tests/modes/internode/test_proxy_faults.py: faults of the RDMA proxy (its process killed or
stopped, a peer's Buffer destroyed) and of a rank with a forked child, across 2 emulated hosts of 2 ranks
(``TRITON_EP_RDMA=emulated``, ``TRITON_EP_RANKS_PER_HOST=2``), low-latency mode; the proxy kind comes from the
test's environment (``TRITON_EP_PROXY``)."""
import os
import signal
import time

import torch

import triton_ep
import triton_ep.testing
from tests.cases.dead_peer import _buffer, _warm_up
from tests.cases.helpers import all_live_ranks_reach

#: 2 hosts of 2 ranks over the emulated fabric
ENV = {"TRITON_EP_RDMA": "emulated", "TRITON_EP_RANKS_PER_HOST": "2"}


def _calls(call, n: int = 2) -> list:
    """Make ``call`` ``n`` times; per call ``[error type or "no error", its text, seconds]``."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            call()
            out.append(["no error", "", time.monotonic() - t0])
        except Exception as ex:     # noqa: BLE001 - reported
            out.append([type(ex).__name__, str(ex), time.monotonic() - t0])
    return out


def _destroy_s(buf) -> float:
    t0 = time.monotonic()
    buf.destroy()
    return time.monotonic() - t0


def ll_proxy_killed(rank, world, victim, timeout_s):
    """Every rank makes a correct low-latency dispatch; after a barrier rank ``victim``'s proxy process is SIGKILLed
    (by its rank) and every rank makes the dispatch twice, then destroys its Buffer. Returns ``[the calls
    (:func:`_calls`), seconds destroy() took]``."""
    import torch.distributed as dist
    os.environ.update(ENV)
    buf, args = _buffer(rank, world, True, timeout_s)
    try:
        call = _warm_up(buf, "internode_ll", *args)
        dist.barrier()
        if rank == victim:
            os.kill(buf._ll.net.sched.proc.pid, signal.SIGKILL)
        out = _calls(call)
    except BaseException:
        buf.destroy()
        raise
    return [out, _destroy_s(buf)]


def _over_tcp(rank: int, world: int, port: int, store_timeout_s: float) -> None:
    """Rebuild the default process group over a TCPStore hosted by rank 0 on ``port`` (run_ranks' group uses a file
    store): ``torchrun``'s kind of store, whose server is a thread of rank 0's process."""
    import datetime

    import torch.distributed as dist
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=store_timeout_s))


def died_with_child(rank, world, mode, timeout_s, done_path, port=None, store_timeout_s=120.0):
    """Every rank makes a correct call of ``mode`` (:data:`tests.cases.dead_peer.HOST_MODES`); rank 0 then forks a
    child that lives on (as a data-loader worker forked after the Buffer was built would: it holds whatever rank 0
    held open, the group's store's sockets among them) until ``done_path`` exists (60 s at most), and after a barrier
    rank 0 dies (SIGKILL). The survivors make the call and destroy their Buffers; the last of them to finish creates
    ``done_path``. With ``port`` the group is rebuilt over a TCPStore hosted by rank 0 (:func:`_over_tcp`, timeout
    ``store_timeout_s``) and the survivors end without tearing the group down (its store no longer answers:
    :func:`triton_ep.testing.exit_after_return`). Returns on a survivor ``[the call (:func:`_calls`, once), seconds
    destroy() took]``."""
    import torch.distributed as dist
    os.environ.update(ENV)
    if port is not None:
        _over_tcp(rank, world, port, store_timeout_s)
    buf, args = _buffer(rank, world, mode.startswith("internode_ll"), timeout_s)
    try:
        call = _warm_up(buf, mode, *args)
        if rank == 0 and os.fork() == 0:
            try:
                end = time.monotonic() + 60.0
                while not os.path.exists(done_path) and time.monotonic() < end:
                    time.sleep(0.05)
            finally:
                os._exit(0)
        dist.barrier()
        if rank == 0:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        out = _calls(call, 1)
    except BaseException:
        buf.destroy()
        raise
    out = [out, _destroy_s(buf)]
    if port is not None:        # (rank 0's store server does not answer: the group's teardown would wait on it)
        triton_ep.testing.exit_after_return()
    with open(f"{done_path}.{rank}", "w"):
        pass
    if all(os.path.exists(f"{done_path}.{r}") for r in range(1, world)):
        with open(done_path, "w"):
            pass
    return out


def _destroy_resuming(buf, pid) -> float:
    """Destroy the Buffer (it ends its stopped proxy process), then resume (SIGCONT) the proxy process ``pid`` that
    this rank stopped, if any, so that nothing stays stopped (gone by then, or a zombie reaped). Returns the seconds
    destroy() took."""
    try:
        return _destroy_s(buf)
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _sched(buf, mode: str):
    """The Buffer's RDMA scheduler across hosts: the low-latency leg's (``mode`` "internode_ll") or the normal
    mode's."""
    return buf._ll.net.sched if mode == "internode_ll" else buf._modes.internode.sched


def proxy_stopped(rank, world, mode, victim, timeout_s, slow_watch_s=0.0):
    """Every rank makes a correct call of ``mode`` ("internode" or "internode_ll":
    :func:`tests.cases.dead_peer._warm_up`); after a barrier rank ``victim`` stops its own proxy process (SIGSTOP)
    and every rank makes the call twice, waits for every other rank to be done (the group's store), then destroys
    its Buffer (on the victim that ends the stopped proxy; it is resumed, SIGCONT, on every path, so that nothing
    stays stopped). ``slow_watch_s``: the victim's host mate's thread looks at the peers'
    fault notices that many seconds apart (:data:`triton_ep.proxy_process.notices.FAULT_POLL_S`), as a loaded
    machine may, so the victim's failure words reach it before that thread's look. Returns ``[the calls
    (:func:`_calls`), seconds destroy() took, this rank's proxy's pid]``."""
    import torch.distributed as dist
    os.environ.update(ENV)
    if slow_watch_s and rank == victim ^ 1:     # (the victim's host mate: 2 ranks a host)
        from triton_ep.proxy_process import notices
        notices.FAULT_POLL_S = slow_watch_s
    buf, args = _buffer(rank, world, mode == "internode_ll", timeout_s)
    pid = None
    try:
        call = _warm_up(buf, mode, *args)
        pid = _sched(buf, mode).proc.pid
        dist.barrier()
        if rank == victim:
            os.kill(pid, signal.SIGSTOP)
        out = _calls(call)
        all_live_ranks_reach(world, bound_s=60.0)      # (so that no rank's teardown is what a slow one hears first)
    except BaseException:
        _destroy_resuming(buf, pid if rank == victim else None)
        raise
    return [out, _destroy_resuming(buf, pid if rank == victim else None), pid]


def ll_proxy_stopped_while_meeting(rank, world, victim, timeout_s, stop_after_s=1.0):
    """Low latency across hosts: after a warm-up dispatch and a barrier every rank but ``victim`` makes a dispatch
    with a float32 ``x`` (refused on the host: its peers are told, the next call re-synchronises the group) and then
    a correct one, which waits at the meeting 'low-latency across hosts: re-synchronise after an error'. The victim
    stops its own proxy process (SIGSTOP) ``stop_after_s`` seconds after the barrier (the others are at the meeting
    by then), waits until its rank found it stopped (its scheduler's error: the peers are told through the group's
    store), then makes the correct dispatch twice (it raises its ProxyError at once, never comes to the meeting).
    Every rank waits for every other rank to be done, then destroys its Buffer (the victim's proxy is resumed,
    SIGCONT, on every path). Returns ``[the calls (:func:`_calls`; the refused one first), seconds destroy() took]``."""
    import torch.distributed as dist
    os.environ.update(ENV)
    buf, args = _buffer(rank, world, True, timeout_s)
    pid = None
    try:
        call = _warm_up(buf, "internode_ll", *args)
        sched = buf._ll.net.sched
        dist.barrier()
        if rank == victim:
            time.sleep(stop_after_s)
            pid = sched.proc.pid
            os.kill(pid, signal.SIGSTOP)
            end = time.monotonic() + timeout_s
            while sched.error is None and time.monotonic() < end:
                time.sleep(0.01)
            out = _calls(call)
        else:
            x, idx, _, N, E = args
            out = _calls(lambda: buf.low_latency_dispatch(x.float(), idx, N, E, use_fp8=False), 1) + _calls(call, 1)
        all_live_ranks_reach(world, bound_s=60.0)
    except BaseException:
        _destroy_resuming(buf, pid)
        raise
    return [out, _destroy_resuming(buf, pid)]


def ll_destroyed_early(rank, world, victim, timeout_s):
    """Every rank makes a correct low-latency dispatch; after a barrier rank ``victim`` destroys its Buffer (a clean
    close: its process lives on until every rank is done) while every other rank makes the dispatch twice and then
    destroys its Buffer at once, as a job that failed does. Returns ``[the calls (:func:`_calls`; none on the
    victim), seconds destroy() took]``."""
    import torch.distributed as dist
    os.environ.update(ENV)
    buf, args = _buffer(rank, world, True, timeout_s)
    try:
        call = _warm_up(buf, "internode_ll", *args)
        dist.barrier()
        out = [] if rank == victim else _calls(call)
    except BaseException:
        buf.destroy()
        raise
    destroy_s = _destroy_s(buf)
    all_live_ranks_reach(world, bound_s=60.0)       # (the victim's process lives until every rank is done)
    return [out, destroy_s]
