"""Shared pytest set-up: hypothesis profiles, the GPU marker and the extended tier (``--extended``).

Profiles: ``ci`` (default; derandomized, few examples, no deadline) and ``deep`` (many examples), chosen
by ``TRITON_EP_HYPOTHESIS=deep``.
"""
import os
import sys
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, settings

import triton_ep  # noqa: F401 - before any test module imports triton: it sets TRITON_INTERPRET=1 on CPU

sys.path.insert(0, os.path.dirname(__file__))
# the repository root: ``tests`` is a namespace package there, and ``tests.cases`` holds what the tests share
# (rank processes get this path too: spawn hands sys.path over, the fork server takes it as PYTHONPATH)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("TRITON_EP_HYPOTHESIS", "ci"))

#: This run's tag in the name of every /dev/shm file triton-ep makes (``triton_ep.<tag>.*``, see
#: ``triton_ep.transport.ipc.shm_name``), set before any test runs so the rank processes the tests start
#: inherit it: the leak check below counts only files carrying it, never another program's.
SHM_TAG = f"pytest{os.getpid()}-{uuid.uuid4().hex[:12]}"
os.environ["TRITON_EP_SHM_TAG"] = SHM_TAG
# no tuned table from this machine's cache (docs/tuning.md): the tests see the built-in Configs unless they point
# TRITON_EP_TUNING_FILE at a table of their own
os.environ["TRITON_EP_TUNING_FILE"] = os.path.join("/nonexistent", f"triton_ep_tests_{SHM_TAG}", "tuning.json")


#: seconds a GPU test may take (``TRITON_EP_GPU_TEST_TIMEOUT_S``) where pytest-timeout is installed: a hang
#: then fails that test instead of eating the whole run (the GPU machine's image has the plugin)
GPU_TEST_TIMEOUT_S = float(os.environ.get("TRITON_EP_GPU_TEST_TIMEOUT_S", "150"))


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked extended (costlier variants of cases the default run covers)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--extended"):
        tier = pytest.mark.skip(reason="extended tier: a costlier variant of a case the default run covers "
                                       "(pytest --extended runs it)")
        for item in items:
            if item.get_closest_marker("extended") is not None:
                item.add_marker(tier)
    if torch.cuda.is_available():
        if config.pluginmanager.hasplugin("timeout"):
            for item in items:
                if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
                    item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="signal"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _shm_files(tag: str = SHM_TAG, d: str = "/dev/shm") -> set:
    """The files in ``d`` that this run's triton-ep code made: named ``triton_ep.<tag>.*``."""
    from triton_ep.transport.ipc import shm_name
    prefix = shm_name("", tag)
    return {f for f in os.listdir(d) if f.startswith(prefix)} if os.path.isdir(d) else set()


def shm_left_behind(before: set, grace_s: float = 5.0, tag: str = SHM_TAG, d: str = "/dev/shm") -> set:
    """This run's files in ``d`` (see :func:`_shm_files`) that are not in ``before`` and still there after up to
    ``grace_s`` seconds (a rank process of this run may be on its way out). Other programs' files, tagged
    otherwise or not at all, are never counted."""
    new = _shm_files(tag, d) - before
    deadline = time.monotonic() + grace_s
    while new and time.monotonic() < deadline:
        time.sleep(0.1)
        new &= _shm_files(tag, d)
    return new


@pytest.fixture
def no_ranks(monkeypatch):
    """``triton_ep.testing.run_ranks`` replaced by a failure: a test of a bad command-line argument must end
    before any rank process starts (the tuner measures nothing, an example starts nothing)."""
    import triton_ep.testing

    def started(*a, **k):
        raise AssertionError("rank processes started although an argument was bad")
    monkeypatch.setattr(triton_ep.testing, "run_ranks", started)


@pytest.fixture
def shm_check():
    """The shared-memory part of the leak check, for tests of it: ``.tag``, ``.files(tag=...)``,
    ``.left_behind(before, grace_s=..., tag=...)`` (a fixture: ``import conftest`` may find another conftest)."""
    import types
    return types.SimpleNamespace(tag=SHM_TAG, files=_shm_files, left_behind=shm_left_behind)


def _open_fds() -> dict:
    fds = {}
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:          # the descriptor listdir itself used, closed by now
            pass
    return fds


@pytest.fixture
def open_fds():
    """This process's open descriptors now, ``{fd: what it names}``, as the leak check below reads them (a fixture:
    ``import conftest`` may find another conftest): call it for a count inside a test."""
    return _open_fds


#: the test modules holding rank bodies (imported by the fork server, see below)
RANK_BODY_MODULES = tuple(f"tests.cases.{name}" for name in ("helpers", "mp", "ll", "internode", "sched", "metrics",
                                                               "proxy", "elastic")) + ("tests.engines.replay",)
#: imported by the fork server after the rank bodies: ``torch._dynamo``, which torch imports on a process's first
#: TorchDispatchMode (:class:`triton_ep.testing.LiveBytes` in the capture path's peak-memory test: about 3 s of CPU
#: and 110,000 objects in each of its 4 ranks), then :mod:`tests.cases.frozen`, last: every object imported so far
#: goes to the garbage collector's permanent generation, which each forked rank inherits (a full collection there
#: scans what the rank made, not torch's and triton's objects: about 0.09 s a collection on an idle machine)
FORKSERVER_LAST = ("torch._dynamo", "tests.cases.frozen")


@pytest.fixture(autouse=True, scope="session")
def _process_wide_singletons():
    """Start what Python opens once per process on first use (multiprocessing's resource tracker and its
    pipe), so the per-test check below sees only what a test leaves behind."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    # CPU: rank processes fork from one server that imported torch, triton_ep and the rank bodies once
    # (``spawn`` pays about 4 s of CPU per rank for those imports); on a GPU machine they stay spawned
    from triton_ep import testing
    if testing.start_forkserver(RANK_BODY_MODULES + FORKSERVER_LAST):
        testing.START_METHOD = "forkserver"
    _SESSION_CHILDREN.update(_processes())
    if torch.cuda.is_available():          # the driver's own descriptors, opened once
        torch.zeros(1, device="cuda")
    # What the imports made (torch, triton, the test modules) lives as long as the process: out of the garbage
    # collector's sight, the full collection after every test below scans only what tests made (it took about
    # 0.15 s a test, 100 s of the CPU suite, when it scanned everything).
    import gc
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()       # (frozen objects are never freed: nanobind, triton's binding, would report them at exit)


def _last_pid() -> int:
    """The most recently created process or thread id (``/proc/loadavg``'s last field; 0 where there is none)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def _processes(since: int = 0, tag: str = SHM_TAG) -> set:
    """Processes created after the id ``since`` (:func:`_last_pid`; all where ids wrapped since) that a test may
    leave behind: this process's children (zombies included: not reaped), and this run's RDMA proxy processes
    wherever their rank was (their environment carries this run's SHM_TAG). Only the new ids are read (a test
    that started no process costs a listing of /proc)."""
    me, out = os.getpid(), set()
    if _last_pid() < since:
        since = 0
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not d.isdigit() or int(d) <= since:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me:
                out.add(int(d))
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"proxy_main.py" not in f.read():
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if f"TRITON_EP_SHM_TAG={tag}".encode() in f.read().split(b"\0"):
                    out.add(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


#: this process's children that live as long as the session (the fork server, the resource tracker): process ids
#: wrap (pid_max may be 32768), so a test after a wrap scans every process
_SESSION_CHILDREN: set = set()


def processes_left_behind(since: int, grace_s: float = 5.0) -> set:
    """Processes of :func:`_processes` created after ``since`` (not the session's own children) and still there
    after up to ``grace_s`` (a proxy whose rank ended takes up to about a second)."""
    deadline = time.monotonic() + grace_s
    new = _processes(since) - _SESSION_CHILDREN
    while new and time.monotonic() < deadline:
        time.sleep(0.05)
        new &= _processes(since)
    return new


@pytest.fixture(autouse=True)
def nothing_left_behind(request, _process_wide_singletons):
    """Invariant 15 around every test (failure paths included): no new triton_ep files of this run in /dev/shm
    (ours or the rank processes'; see SHM_TAG), no new open descriptors in this process, no new threads, no new
    processes (children of this one, reaped or not; this run's RDMA proxy processes)."""
    import threading
    import gc
    shm0, fds0, threads0, pid0 = _shm_files(), _open_fds(), set(threading.enumerate()), _last_pid()
    yield
    gc.collect()
    new_procs = processes_left_behind(pid0)
    assert not new_procs, f"processes left behind (children of this one, or RDMA proxies of this run): {sorted(new_procs)}"
    new_shm = shm_left_behind(shm0)
    assert not new_shm, f"left in /dev/shm: {sorted(new_shm)}"
    new_fds = {fd: p for fd, p in _open_fds().items() if fds0.get(fd) != p and not p.startswith("/dev/nvidia")}
    assert not new_fds, f"descriptors left open: {new_fds}"
    new_threads = [t for t in threading.enumerate() if t not in threads0 and t.is_alive()]
    assert not new_threads, f"threads left running: {new_threads}"
