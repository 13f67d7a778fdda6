"""Shared pytest set-up: hypothesis profiles and the GPU marker.

Profiles: ``ci`` (default; derandomized, few examples, no deadline) and ``deep`` (many examples), chosen
by ``TRITON_EP_HYPOTHESIS=deep``.
"""
import os
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("TRITON_EP_HYPOTHESIS", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _shm_files() -> set:
    d = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return {f for f in os.listdir(d) if f.startswith("triton_ep.")} if d else set()


def _open_fds() -> dict:
    fds = {}
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:          # the descriptor listdir itself used, closed by now
            pass
    return fds


@pytest.fixture(autouse=True, scope="session")
def _process_wide_singletons():
    """Start what Python opens once per process on first use (multiprocessing's resource tracker and its
    pipe), so the per-test check below sees only what a test leaves behind."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    if torch.cuda.is_available():          # the driver's own descriptors, opened once
        torch.zeros(1, device="cuda")
    yield


@pytest.fixture(autouse=True)
def nothing_left_behind(request, _process_wide_singletons):
    """Invariant 15 around every test (failure paths included): no new triton_ep files in /dev/shm (ours or
    the rank processes'), no new open descriptors in this process, no new threads."""
    import threading
    import gc
    shm0, fds0, threads0 = _shm_files(), _open_fds(), set(threading.enumerate())
    yield
    gc.collect()
    new_shm = _shm_files() - shm0
    # another process's bootstrap (a second test run on the machine) may hold files for a moment: what
    # this test left behind stays, theirs goes
    deadline = time.monotonic() + 5.0
    while new_shm and time.monotonic() < deadline:
        time.sleep(0.1)
        new_shm &= _shm_files()
    assert not new_shm, f"left in /dev/shm: {sorted(new_shm)}"
    new_fds = {fd: p for fd, p in _open_fds().items() if fds0.get(fd) != p and not p.startswith("/dev/nvidia")}
    assert not new_fds, f"descriptors left open: {new_fds}"
    new_threads = [t for t in threading.enumerate() if t not in threads0 and t.is_alive()]
    assert not new_threads, f"threads left running: {new_threads}"
